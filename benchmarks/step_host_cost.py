"""Host cost of preparing one decode step on a worker, before and after the persistent
input batch (issue 13), in the same run.

For ``n`` decoding sequences of ``context`` tokens (block size 16) it drives the
worker's ``RequestStates`` with the deltas the engine sends (one new token per request,
a new block every 16 steps) and times, per step, on the CPU device:

* ``build``: ``RequestStates.update`` + ``build_step``;
* ``metadata_triton`` / ``metadata_torch``: the eager path's attention metadata (with
  the gather of the step's table rows, after);
* ``stage``: the decode-graph path, ``DecodeInputs.fits`` + ``stage`` into the host
  buffer and its copy to the (CPU) device buffer;

and, for the whole step, ``ModelRunner.execute`` around a stub model (a forward that
returns zeros, logits of a 1000-token vocabulary, greedy sampling): ``execute_eager``
(Triton metadata, eager) and ``execute_graph`` (the decode-graph path, padded, without
graphs on CPU). Each number is a median over ``--steps`` steps; each configuration runs
``--repeats`` times per side, the sides alternating, and the table keeps the lowest
median (on a shared machine, the run least disturbed by others). The baseline is the same
loop over another commit's ``vtllm`` (``--baseline-ref``, extracted with ``git archive``
into a temporary directory; nothing in the checkout changes), each run in its own
process::

    python benchmarks/step_host_cost.py [--baseline-ref e6089f1] [--steps 300] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# main before the persistent input batch (the last commit whose steps rebuilt whole
# block tables from lists)
BASELINE_REF = "e6089f1"
FIELDS = (
    "build",
    "stage",
    "metadata_triton",
    "metadata_torch",
    "graph_step",
    "eager_step",
    "execute_graph",
    "execute_eager",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-ref", default=BASELINE_REF)
    parser.add_argument("--num-seqs", default="1,64,256")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.n, args.context, args.block_size, args.steps, args.warmup)))
        return
    with tempfile.TemporaryDirectory(prefix="step_host_cost_") as baseline_root:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.baseline_ref, "vtllm"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", baseline_root], input=archive, check=True)
        rows = []
        for context in map(int, args.contexts.split(",")):
            for n in map(int, args.num_seqs.split(",")):
                result = {"n": n, "context": context}
                runs: dict[str, list[dict]] = {"baseline": [], "persistent": []}
                for _ in range(args.repeats):
                    for label, root in (("baseline", baseline_root), ("persistent", str(REPO))):
                        runs[label].append(run_worker(root, n, context, args))
                for label, results in runs.items():
                    result[label] = {name: min(r[name] for r in results) for name in FIELDS}
                print(json.dumps(result), flush=True)
                rows.append(result)
    print_table(rows, args.baseline_ref)


def run_worker(root: str, n: int, context: int, args: argparse.Namespace) -> dict:
    """One configuration in a fresh process importing ``vtllm`` from ``root``."""
    command = [sys.executable, __file__, "--worker", f"--n={n}", f"--context={context}"]
    command += [f"--block-size={args.block_size}", f"--steps={args.steps}"]
    command += [f"--warmup={args.warmup}"]
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(n: int, context: int, block_size: int, steps: int, warmup: int) -> dict:
    """Median milliseconds per step of each part, over ``steps`` decode steps."""
    import numpy as np
    import torch

    from vtllm.protocol.messages import (
        CachedRequestData,
        NewRequestData,
        SamplingParams,
        SchedulerOutput,
    )
    from vtllm.worker import attention
    from vtllm.worker.decode_graphs import DecodeInputs, capture_sizes, padded_size
    from vtllm.worker.input_batch import RequestStates
    from vtllm.worker.platform import cpu_platform

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    persistent = hasattr(attention, "attention_metadata")

    def metadata(batch, backend: str):
        if persistent:
            return attention.attention_metadata(
                batch.query_lens,
                batch.seq_lens,
                batch.query_start_loc,
                batch.block_tables(),
                batch.slot_mapping,
                block_size,
                cpu,
                backend,
            )
        return attention.build_attention_metadata(
            batch.query_lens, batch.seq_lens, batch.block_tables, block_size, cpu, backend
        )

    rng = np.random.default_rng(0)
    num_blocks = n * (-(-(context + warmup + steps) // block_size) + 1)
    free_blocks = rng.permutation(np.arange(1, num_blocks + 1)).tolist()
    max_model_len = 2 * context  # the graphs' table width W = max_model_len / block_size
    staging = DecodeInputs(
        padded_size(capture_sizes(max(n, 8)), n),
        -(-max_model_len // block_size),
        block_size,
        cpu_platform(),
    )
    states = RequestStates(lambda params, num_outputs: None)
    greedy = SamplingParams(temperature=0.0)
    ids = [f"req-{i}" for i in range(n)]
    tables = {rid: [free_blocks.pop() for _ in range(-(-context // block_size))] for rid in ids}
    prompt = rng.integers(0, 32000, size=context).tolist()
    step = SchedulerOutput(
        0,
        [
            NewRequestData(rid, list(prompt), context, greedy, tables[rid], context - 1)
            for rid in ids
        ],
        [],
        {rid: 1 for rid in ids},
    )
    times: dict[str, list[float]] = {name: [] for name in FIELDS}
    num_computed = context - 1
    for step_id in range(warmup + steps):
        started = time.perf_counter()
        states.update(step)
        batch = states.build_step(step, block_size)
        built = time.perf_counter()
        assert staging.fits(batch) and not batch.errors
        staging.stage(batch)
        staged = time.perf_counter()
        metadata(batch, "triton")
        triton_done = time.perf_counter()
        metadata(batch, "torch")
        torch_done = time.perf_counter()
        if step_id >= warmup:
            times["build"].append(built - started)
            times["stage"].append(staged - built)
            times["metadata_triton"].append(triton_done - staged)
            times["metadata_torch"].append(torch_done - triton_done)
            times["graph_step"].append(staged - started)
            times["eager_step"].append(built - started + triton_done - staged)
        # the next step's deltas: the sampled token, a block when a new one starts
        num_computed += 1
        needs_block = num_computed % block_size == 0
        cached = [
            CachedRequestData(rid, [7], [free_blocks.pop()] if needs_block else [], num_computed)
            for rid in ids
        ]
        step = SchedulerOutput(step_id + 1, [], cached, {rid: 1 for rid in ids})
    times["execute_graph"] = measure_execute(n, context, block_size, steps, warmup, True)
    times["execute_eager"] = measure_execute(n, context, block_size, steps, warmup, False)
    medians = {name: round(statistics.median(v) * 1e3, 4) for name, v in times.items()}
    return {"persistent": persistent, **medians}


def measure_execute(
    n: int, context: int, block_size: int, steps: int, warmup: int, graphs: bool
) -> list[float]:
    """Seconds of ``ModelRunner.execute`` per decode step around a stub model, through
    the decode-graph path (``graphs``: padded inputs, run eagerly on CPU) or eagerly."""
    import torch
    from torch import nn

    from vtllm.protocol.messages import (
        CachedRequestData,
        NewRequestData,
        SamplingParams,
        SchedulerOutput,
    )
    from vtllm.worker.model_runner import ModelRunner
    from vtllm.worker.platform import cpu_platform

    class StubModel(nn.Module):
        """Zeros for hidden states: only the runner's own host work is left."""

        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Parameter(torch.randn(8, 1000))
            attn = nn.Module()
            attn.num_kv_heads = 1  # read by capture_decode_graphs
            layer = nn.Module()
            layer.self_attn = attn
            self.model = nn.Module()
            self.model.layers = [layer]

        def kv_cache_specs(self) -> list[tuple[int, int]]:
            return [(1, 8)]

        def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
            return torch.zeros(len(input_ids), 8)  # [num_tokens, hidden]

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden @ self.lm_head  # [rows, vocab]

    blocks_per_seq = -(-(context + warmup + steps) // block_size)
    runner = ModelRunner(StubModel(), torch.device("cpu"), torch.float32, 1000, seed=0)
    runner.init_kv_cache(n * blocks_per_seq + 1, block_size)
    runner.attention_backend = "triton"
    if graphs:
        runner.capture_decode_graphs(cpu_platform(), n, 2 * context, use_graphs=False)
    free_blocks = list(range(1, n * blocks_per_seq + 1))
    ids = [f"req-{i}" for i in range(n)]
    greedy = SamplingParams(temperature=0.0)
    prompt = list(range(context))
    step = SchedulerOutput(
        0,
        [
            NewRequestData(
                rid,
                prompt,
                context,
                greedy,
                [free_blocks.pop() for _ in range(-(-context // block_size))],
                context - 1,
            )
            for rid in ids
        ],
        [],
        {rid: 1 for rid in ids},
    )
    times = []
    num_computed = context - 1
    for step_id in range(warmup + steps):
        started = time.perf_counter()
        output = runner.execute(step)
        times.append(time.perf_counter() - started)
        assert output is not None and not output.errors and len(output.request_ids) == n
        num_computed += 1
        needs_block = num_computed % block_size == 0
        cached = [
            CachedRequestData(
                rid, [token], [free_blocks.pop()] if needs_block else [], num_computed
            )
            for rid, token in zip(output.request_ids, output.sampled_token_ids, strict=True)
        ]
        step = SchedulerOutput(step_id + 1, [], cached, {rid: 1 for rid in ids})
    return times[warmup:]


def print_table(rows: list[dict], baseline_ref: str) -> None:
    """Markdown: per configuration, baseline → persistent median ms of each part."""
    print(f"\nmedian ms per step; baseline = {baseline_ref}, eager_step = build + metadata_triton")
    print("| seqs | context | " + " | ".join(FIELDS) + " |")
    print("|---" * (2 + len(FIELDS)) + "|")
    for row in rows:
        cells = []
        for name in FIELDS:
            before, after = row["baseline"][name], row["persistent"][name]
            cells.append(f"{before:.3f} → {after:.3f} ({before / max(after, 1e-9):.1f}×)")
        print(f"| {row['n']} | {row['context']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
