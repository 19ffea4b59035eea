"""Per-step cost of structured outputs: filling the token bitmask of every row on the
host (xgrammar) plus applying it to the logits on the device, against the same sampling
step without a grammar (every row at the start of its schema). Tokenizer: --tokenizer-dir (its tokenizer.json).

    python benchmarks/structured_output_cost.py --tokenizer-dir DIR [--rows 64] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from vtllm.protocol.messages import SamplingParams, StructuredOutputKind, StructuredOutputSpec
from vtllm.worker.grammar import GrammarCompilerService, StructuredOutputs
from vtllm.worker.sampler import Sampler, SamplingBatch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "tags"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer-dir", required=True)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    tokenizer_json = Path(args.tokenizer_dir, "tokenizer.json").read_text(encoding="utf-8")
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    vocab_size = max(vocab.values()) + 1
    compilers = GrammarCompilerService(args.tokenizer_dir, vocab_size, [0])
    grammars = StructuredOutputs(compilers)
    spec = StructuredOutputSpec(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA))
    rows = [(f"r{i}", [1], 1) for i in range(args.rows)]
    for request_id, _, _ in rows:
        grammars.add(request_id, spec)
    sampler = Sampler(0, device)
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * args.rows
    batch = SamplingBatch.from_params(params, {}, vocab_size, device)
    logits = torch.randn(args.rows, vocab_size, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(with_grammar: bool) -> tuple[float, float]:
        fill_s = total_s = 0.0
        for _ in range(args.steps):
            sync()
            started = time.perf_counter()
            batch.grammar_mask = None
            if with_grammar:
                mask, errors = grammars.bitmask(rows)
                assert not errors, errors
                fill_s += time.perf_counter() - started
                index = torch.tensor(mask.rows, dtype=torch.int64).to(device)
                batch.grammar_mask = (index, mask.bitmask.to(device, non_blocking=True))
            sampler(logits, batch)
            sync()
            total_s += time.perf_counter() - started
        return fill_s / args.steps * 1e3, total_s / args.steps * 1e3

    timed(True), timed(False)  # warm-up (compile, kernels)
    fill_ms, with_ms = timed(True)
    _, without_ms = timed(False)
    print(
        f"device={device} rows={args.rows} vocab={vocab_size} steps={args.steps}: "
        f"sampling step without grammar {without_ms:.3f} ms, with grammar {with_ms:.3f} ms "
        f"(bitmask fill {fill_ms:.3f} ms, apply + transfer {with_ms - fill_ms - without_ms:.3f} ms)"
    )


if __name__ == "__main__":
    main()
