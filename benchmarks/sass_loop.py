"""The main loop of a kernel as the GPU runs it, with no GPU: compile AOT variants for
sm_90 and count the SASS instructions of each loop (no device time).

Uses the variants of ``tests/worker/kernels/aot_compile.py`` (``aligned`` ones carry the
JIT's 16-byte alignment hints, as served shapes get them) and the ``cuobjdump`` that the
triton wheel ships. Install the device's Triton beside the venv's to read what the H200
runs (session 41: Triton 3.6, whose bundled ptxas is 12.8)::

    pip install --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 TRITON_INTERPRET=0 python benchmarks/sass_loop.py \\
        paged_attention/decode-prep-bf16-fp8kv

One JSON line a variant: registers and stack bytes a thread, shared memory, and for each
loop (a backward branch) its instruction count and the loads, conversions and matrix
instructions in it. An e4m3 tile read one byte at a time shows as ``LDS.U8``/``LDG.E.U8``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# opcode prefixes reported per loop (the rest are counted in "instructions" only)
REPORTED = ("LDS", "LDSM", "LDG", "LDGSTS", "STS", "STSM", "F2FP", "HMMA", "HGMMA", "QGMMA")
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);")
_BRANCH_TARGET = re.compile(r"BRA.*0x([0-9a-f]+)")


def loops(sass: str) -> list[dict]:
    """Each backward branch's span of ``sass`` (cuobjdump text): instruction count and
    the REPORTED opcodes' counts."""
    instructions = []  # (address, text without its predicate)
    for line in sass.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            text = re.sub(r"^@!?U?P\w+\s+", "", match.group(2).strip())
            instructions.append((int(match.group(1), 16), text))
    found = []
    for address, text in instructions:
        target = _BRANCH_TARGET.search(text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            body = [t.split()[0] for a, t in instructions if start <= a <= address]
            counts = collections.Counter(op for op in body if op.startswith(REPORTED))
            found.append({"instructions": len(body), **dict(sorted(counts.items()))})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="aot_compile variant-name prefixes")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run with TRITON_INTERPRET=0: the interpreter compiles nothing")
    sys.path.insert(0, str(REPO_ROOT))
    import triton

    from tests.worker.kernels import aot_compile

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    target_name = "h100-sm90"
    for variant in aot_compile.VARIANTS:
        if not any(variant.name.startswith(v) for v in args.variants):
            continue
        source = variant.source(target_name)
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["TRITON_CACHE_DIR"] = tmp  # every Triton version reads it
            compiled = triton.compile(
                source,
                target=aot_compile.TARGETS[target_name],
                options={"num_warps": variant.num_warps, "num_stages": variant.num_stages},
            )
            cubin = Path(tmp) / "kernel.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            sass = subprocess.run(
                [cuobjdump, "--dump-sass", cubin], capture_output=True, text=True, check=True
            ).stdout
            usage = subprocess.run(
                [cuobjdump, "--dump-resource-usage", cubin], capture_output=True, text=True
            ).stdout
        resources = dict(re.findall(r"(REG|STACK):(\d+)", usage))
        row = {
            "variant": variant.name,
            "triton": triton.__version__,
            "registers": int(resources.get("REG", -1)),
            "stack_bytes": int(resources.get("STACK", -1)),
            "shared_bytes": compiled.metadata.shared,
            "loops": loops(sass),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
