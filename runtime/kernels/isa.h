/* The instruction sets the CPU kernels dispatch on, in one place: each extension includes this header, probes the
 * CPU once when it is imported, and runs the best path the CPU has, or a lower one that runtime/kernels/isa.py
 * chose (WARMSTART_CPU_ISA, tests): ``isa()`` says which, ``isa(name)`` sets it.
 *
 * Levels, each including the ones below it: portable C (any CPU, aarch64 too), AVX2 with FMA and F16C (x86-64 since
 * Haswell and Zen 1), AVX-512 (F, BW, DQ, VL) and AVX-512 with its BF16 dot products. The AVX code of every
 * extension is compiled only for x86 (WARMSTART_X86) and runs only under the level that has it. */
#ifndef WARMSTART_ISA_H
#define WARMSTART_ISA_H

#include <Python.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define WARMSTART_X86 1
#else
#define WARMSTART_X86 0
#endif

enum { ISA_PORTABLE, ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16, ISA_LEVELS };

static const char *const isa_names[ISA_LEVELS] = {"portable", "avx2", "avx512", "avx512_bf16"};

static int isa_best = ISA_PORTABLE; /* what this CPU has */
static int isa_level = ISA_PORTABLE; /* what the kernels use: isa_best unless lowered */

static int isa_probe(void) {
#if WARMSTART_X86
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return ISA_PORTABLE;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")))
        return ISA_AVX2;
    return __builtin_cpu_supports("avx512bf16") ? ISA_AVX512_BF16 : ISA_AVX512;
#else
    return ISA_PORTABLE;
#endif
}

/* Called from the extension's PyInit. */
static void isa_init(void) { isa_level = isa_best = isa_probe(); }

/* isa() -> the level in use; isa(name) sets it, to any level up to the CPU's best. */
static PyObject *isa_method(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name)) return NULL;
    if (name != NULL) {
        int found = -1;
        for (int i = 0; i < ISA_LEVELS; i++)
            if (strcmp(name, isa_names[i]) == 0) found = i;
        if (found < 0 || found > isa_best)
            return PyErr_Format(PyExc_ValueError, "isa: %s is not an instruction set this CPU has (it has up to %s)",
                                name, isa_names[isa_best]);
        isa_level = found;
    }
    return PyUnicode_FromString(isa_names[isa_level]);
}

static PyObject *isa_best_method(PyObject *self, PyObject *args) { return PyUnicode_FromString(isa_names[isa_best]); }

#define ISA_METHODS                                                                                                 \
    {"isa", isa_method, METH_VARARGS, "isa([name]): the instruction set the kernels use; a name sets it (at most "  \
                                      "best_isa())"},                                                               \
    {"best_isa", isa_best_method, METH_NOARGS, "the best instruction set this CPU has for these kernels"}

#endif
