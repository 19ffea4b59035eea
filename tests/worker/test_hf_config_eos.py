"""The engine's EOS set is the model's, decided in one place (``hf_config.eos_token_ids``):
generation_config's eos ids plus tokenizer_config's ``eos_token`` (a chat model's
end-of-turn token is often only there); frontends add nothing to it."""

from __future__ import annotations

import json
from pathlib import Path

from tests.frontend.conftest import write_model_dir
from vtllm.worker.loader.hf_config import eos_token_ids


def test_eos_ids_include_the_tokenizer_eos_token(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "m")  # generation eos 0; tokenizer eos <|im_end|> = 2
    assert eos_token_ids(model_dir, {}) == [0, 2]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    assert eos_token_ids(model_dir, {}) == [2, 1]  # no duplicate


def test_eos_ids_without_tokenizer_files(tmp_path: Path) -> None:
    assert eos_token_ids(tmp_path, {"eos_token_id": 7}) == [7]
    assert eos_token_ids(tmp_path, {}) == []
