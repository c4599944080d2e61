"""handlers.openai.sampling_controls through parse_completion: the fields become SamplingParams, the model's
generation_config repetition_penalty is the default, bad values a 400 naming the field."""

from __future__ import annotations

import pytest

from warmstart.handlers.openai.requests import APIError, ServedModel, parse_completion


def model(**defaults: float) -> ServedModel:
    return ServedModel("m", "0" * 32, None, vocab_size=100, max_model_len=64, kv_cache_tokens=1000,
                       sampling_defaults=dict(defaults))


def test_fields_become_sampling_params() -> None:
    gen = parse_completion({"prompt": [1, 2], "max_tokens": 8, "presence_penalty": 0.5, "frequency_penalty": -1,
                            "repetition_penalty": 1.2, "logit_bias": {"7": 100, "9": -3.5}, "min_tokens": 3,
                            "n": 2, "best_of": 3}, model())
    p = gen.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)
    assert p.logit_bias == {7: 100.0, 9: -3.5} and p.min_tokens == 3
    assert (gen.n, p.n) == (2, 3) and p.logprobs == 0 and gen.logprobs is None  # ranked, not shown


def test_generation_config_repetition_penalty_is_the_default() -> None:
    assert parse_completion({"prompt": [1]}, model(repetition_penalty=1.3)).params.repetition_penalty == 1.3
    explicit = parse_completion({"prompt": [1], "repetition_penalty": 1.0}, model(repetition_penalty=1.3))
    assert explicit.params.repetition_penalty == 1.0
    assert parse_completion({"prompt": [1]}, model()).params.repetition_penalty == 1.0


@pytest.mark.parametrize(("body", "param"), [
    ({"bad_words": ["x"]}, "bad_words"),  # no tokenizer to turn words into tokens
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"100": 1}}, "logit_bias"),
    ({"min_tokens": 17}, "min_tokens"),  # max_tokens is 16
    ({"n": 17}, "n"),
    ({"best_of": True}, "best_of"),
])  # fmt: skip
def test_bad_values_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": [1], **body}, model())
    assert e.value.status == 400 and e.value.param == param
