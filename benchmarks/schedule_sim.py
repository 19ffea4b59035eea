"""The shape of `vtllm bench throughput`'s schedule, without a model: how many steps carry
prompt tokens and how many only decode, how big each kind is (CPU: ~7 min a budget here).

The bench's own requests (seed 0: same lengths as every GPU run) go through the real
engine core and scheduler; the worker is the engine-core tests' FakeExecutor, which checks
every step's bookkeeping. Use it to see what a scheduler flag does to the step mix before
spending device time, e.g.::

    python benchmarks/schedule_sim.py --max-num-batched-tokens 8192 16384

Session 40 (defaults: 256 prompts, lengths uniform in [100, 1024], 8,192-token budget):
1,029 steps, as the H200 run's 1,030: 19 with prompt tokens (7,732 each on average), then
1,010 decode-only steps of 135.4 sequences on average.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine_core.fake_executor import FakeExecutor  # noqa: E402
from vtllm.bench import throughput_requests  # noqa: E402
from vtllm.config import VtllmConfig  # noqa: E402
from vtllm.engine_core.core import EngineCore, EngineFacts  # noqa: E402
from vtllm.protocol import messages as m  # noqa: E402

VOCAB = 128_256  # Llama 3's


def simulate(args: argparse.Namespace, budget: int) -> dict[str, float]:
    """One run of the workload: the engine core's step totals by kind."""
    config = VtllmConfig()
    config.scheduler.async_scheduling = True
    config.cache.block_size = 16
    config.scheduler.max_num_batched_tokens = budget
    config.scheduler.max_num_seqs = args.max_num_seqs
    if args.long_prefill_token_threshold is not None:
        config.scheduler.long_prefill_token_threshold = args.long_prefill_token_threshold
    num_blocks = args.num_prompts * (2 * 1024 // 16 + 2)  # every request fits: no preemption
    facts = EngineFacts("sim", args.max_model_len, VOCAB, num_blocks, 16, (2,))
    executor = FakeExecutor(vocab_size=VOCAB, block_size=16, sample=lambda ids, vocab: 5)
    core = EngineCore(config, facts, executor)
    for request_id, prompt, out_len in throughput_requests(args, VOCAB, args.num_prompts, 0, "tp"):
        params = m.SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        core.add_request(b"sim", m.AddRequest(request_id, prompt, params))
    while core.has_work():
        core.step()
    stats = core.utility("get_stats", [])
    result: dict[str, float] = {"max_num_batched_tokens": budget}
    for kind in ("prefill", "decode"):
        steps = stats[f"{kind}_steps_total"]
        result[f"{kind}_steps"] = steps
        result[f"{kind}_tokens_per_step"] = round(stats[f"{kind}_tokens_total"] / max(1, steps), 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--long-prefill-token-threshold", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    for budget in args.max_num_batched_tokens:
        print(simulate(args, budget), flush=True)


if __name__ == "__main__":
    main()
