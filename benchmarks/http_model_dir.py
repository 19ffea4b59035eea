"""A model directory that ``vtllm serve --load-format dummy`` can serve for HTTP benchmarks
of a ``vtllm bench`` shape, with no checkpoint and no network: the shape's config.json and
a synthetic word-level tokenizer over the shape's whole vocabulary (id i is the word
``w<i>``), so every sampled id detokenizes to text and each token costs the frontend a
real SSE event, as with a real tokenizer.

    python3 benchmarks/http_model_dir.py smollm2-135m /tmp/http-smollm2
    vtllm serve --model /tmp/http-smollm2 --load-format dummy ...
    vtllm bench throughput --model /tmp/http-smollm2 --load-format dummy ...   # same model
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from vtllm.bench import shape_config


def write_http_model_dir(shape: str, directory: Path) -> Path:
    config = dict(shape_config(shape))
    vocab_size = config["vocab_size"]
    eos = config["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": f"w{eos}", "bos_token": None, "add_bos_token": False})
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", help="a vtllm bench --model-shape name or config.json")
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    print(write_http_model_dir(args.shape, args.directory))


if __name__ == "__main__":
    main()
