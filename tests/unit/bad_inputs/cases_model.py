"""Rows of the bad-input table: the model folder, and what the model can serve."""

from __future__ import annotations

import shutil

from tests.unit.bad_inputs.workspace import (
    _M,
    TINY,
    Case,
    _bad_header,
    _bigger_tokenizer,
    _bin_weights,
    _model,
    _model_json,
    _rm,
    _shard_missing,
    _train,
    _truncate,
)

MODEL: list[Case] = [
    # --- model folder
    Case(
        "model folder missing",
        "model",
        _train(),
        ("model folder", "does not exist", "model.path"),
        setup=lambda ws: shutil.rmtree(ws.model),
    ),
    Case(
        "model path is a file",
        "model",
        lambda ws: [*_train()(ws), f"actor_rollout_ref.model.path={ws.train}"],
        ("is a file", "model.path"),
    ),
    Case(
        "no config.json",
        "model",
        _train(),
        ("config.json", "model.path"),
        setup=_model(_rm("config.json")),
    ),
    Case(
        "config.json not JSON",
        "model",
        _train(),
        ("config.json", "not readable JSON"),
        setup=_model(lambda m: (m / "config.json").write_text("{oops")),
    ),
    Case(
        "pickled weights only",
        "model",
        _train(),
        ("no *.safetensors", "safetensors"),
        setup=_model(_bin_weights),
    ),
    Case(
        "truncated model.safetensors",
        "model",
        _train(),
        ("model.safetensors", "truncated", "copy or download"),
        setup=_truncate(_M, 0.6),
    ),
    Case(
        "garbage safetensors header",
        "model",
        _train(),
        ("model.safetensors", "header"),
        setup=_model(_bad_header),
    ),
    Case(
        "no tokenizer.json",
        "model",
        _train(),
        ("tokenizer.json", "tokenizer_path"),
        setup=_model(lambda m: ((m / "tokenizer.json").unlink(), shutil.rmtree(m / "tokenizer"))),
    ),
    Case(
        "tokenizer_path missing",
        "model",
        _train("actor_rollout_ref.model.tokenizer_path=/nonexistent/tok"),
        ("tokenizer.json", "tokenizer_path"),
    ),
]


SERVING: list[Case] = [
    # --- what the model can serve (checked before Prefect and Ray start)
    Case(
        "response beyond the model's positions",
        "model fit",
        _train("data.max_prompt_length=64", "data.max_response_length=300"),
        ("64 + 300 = 364", "256 positions", "data.max_response_length", "lower data.max_prompt_length"),
        "PreflightError",
    ),
    Case(
        "prompt alone beyond the model's positions",
        "model fit",
        _train("data.max_prompt_length=300", "data.max_response_length=16"),
        ("300 + 16 = 316", "256 positions", "max_position_embeddings"),
        "PreflightError",
    ),
    Case(
        "tiny model with too few positions",
        "model fit",
        lambda ws: [
            "train",
            "--config",
            TINY,
            f"trainer.runs_dir={ws.runs}",
            "actor_rollout_ref.model.tiny.max_position_embeddings=64",
        ],
        ("has 64 positions", "actor_rollout_ref.model.tiny.max_position_embeddings", "at least"),
        "PreflightError",
    ),
    Case(
        "tokenizer larger than the embedding",
        "model fit",
        _train(),
        ("100 tokens", "40 embedding rows", "vocab_size", "resize the model's embeddings"),
        "PreflightError",
        setup=_model(_model_json("config.json", vocab_size=40)),
    ),
    Case(
        "tokenizer_path with a bigger vocabulary",
        "model fit",
        lambda ws: [*_train()(ws), f"actor_rollout_ref.model.tokenizer_path={ws.root / 'other_tok'}"],
        ("160 tokens", "100 embedding rows", "actor_rollout_ref.model.tokenizer_path"),
        "PreflightError",
        setup=_bigger_tokenizer,
    ),
    Case(
        "no chat template",
        "model fit",
        _train(),
        ("no chat template", "chat messages", "chat_template"),
        "PreflightError",
        setup=_model(_rm("chat_template.jinja")),
    ),
    Case(
        "half-written tokenizer.json",
        "model fit",
        _train(),
        ("tokenizer.json is not readable JSON", "half-written", "copy the tokenizer files again"),
        "PreflightError",
        setup=_truncate(lambda ws: ws.model / "tokenizer.json", 0.5),
    ),
    Case(
        "half-written tokenizer_config.json",
        "model fit",
        _train(),
        ("tokenizer_config.json is not readable JSON", "copy the tokenizer files again"),
        "PreflightError",
        setup=_truncate(lambda ws: ws.model / "tokenizer_config.json", 0.5),
    ),
    Case(
        "sharded model, a shard not downloaded",
        "model fit",
        _train(),
        ("model-00002-of-00002.safetensors is missing", "actor_rollout_ref.model.path"),
        "PreflightError",
        setup=_model(_shard_missing),
    ),
    Case(
        "CPU memory plan beyond this machine",
        "model fit",
        _train("trainer.device=cpu"),
        ("on CPU every role shares this machine's memory", "is available", "Change:", "dapo plan"),
        "PreflightError",
        setup=_model(
            _model_json(
                "config.json",
                hidden_size=16384,
                intermediate_size=65536,
                num_hidden_layers=200,
                num_attention_heads=128,
                num_key_value_heads=128,
                head_dim=128,
            )
        ),
    ),
]
