"""The handler a user would write without warmstart: Starlette + transformers, for benchmarks/cold_start.py.

    MODEL_DIR=DIR [DEVICE=cuda] [DTYPE=bfloat16] python -m uvicorn benchmarks.hf_handler:app --port PORT

It imports transformers, loads the model with `from_pretrained` at start-up, and answers OpenAI-style chat
and (token-id) completion requests with `generate`, one at a time, prefilling the whole rendered
conversation (system prompt included) on every request. /health is 503 until the model is loaded, as a
startup probe expects. DEVICE (default cpu) and DTYPE (default bfloat16) place the model. Used by
benchmarks/cold_start.py, benchmarks/serve_load.py and benchmarks/gpu_check.py.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

state: dict[str, Any] = {}


def load() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = os.environ["MODEL_DIR"]
    state["tokenizer"] = AutoTokenizer.from_pretrained(model_dir)
    dtype = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    state["model"] = model.to(os.environ.get("DEVICE", "cpu")).eval()


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"ready": "model" in state}, status_code=200 if "model" in state else 503)


async def chat(request: Request) -> JSONResponse:
    import torch

    body = await request.json()
    tok, model = state["tokenizer"], state["model"]
    ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids.to(model.device)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=body.get("max_tokens", 16), do_sample=False)
    new = out[0, ids["input_ids"].shape[1] :]
    return JSONResponse({"choices": [{"message": {"role": "assistant", "content": tok.decode(new)}}],
                         "usage": {"prompt_tokens": ids["input_ids"].shape[1], "completion_tokens": len(new)}})


async def completions(request: Request) -> JSONResponse:
    """Token-id prompts (benchmarks/serve_load.py), greedy, EOS ignored: exactly max_tokens come out."""
    import torch

    body = await request.json()
    ids = torch.tensor([body["prompt"]], device=state["model"].device)
    with torch.no_grad():
        out = state["model"].generate(ids, max_new_tokens=body["max_tokens"], min_new_tokens=body["max_tokens"],
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, ids.shape[1] :].tolist()
    return JSONResponse({"choices": [{"text": "", "token_ids": new}],
                         "usage": {"prompt_tokens": ids.shape[1], "completion_tokens": len(new)}})


threading.Thread(target=load, daemon=True).start()
app = Starlette(routes=[
    Route("/health", health),
    Route("/v1/chat/completions", chat, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
])
