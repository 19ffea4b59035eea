"""A minimal non-HTTP frontend: talks to a running engine core with vtllm.protocol alone.

    vtllm engine-core --engine-address ipc:///tmp/vtllm-engine.sock &
    python examples/minimal_frontend.py ipc:///tmp/vtllm-engine.sock 1 504 3

Sends the token ids given on the command line, streams the generated ids back, prints
them as they arrive. No tokenizer, no torch: token ids in, token ids out.
"""

from __future__ import annotations

import sys
import uuid

from vtllm.protocol.client import EngineCoreClient
from vtllm.protocol.messages import SamplingParams


def main() -> int:
    address = sys.argv[1] if len(sys.argv) > 1 else "ipc:///tmp/vtllm-engine.sock"
    prompt = [int(t) for t in sys.argv[2:]] or [1, 504, 3]
    with EngineCoreClient(address, "minimal-frontend") as client:
        ready = client.ready
        print(f"connected: model={ready.model} max_model_len={ready.max_model_len}")
        request_id = uuid.uuid4().hex
        client.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=16))
        for output in client.stream(request_id):
            print("tokens", output.new_token_ids, flush=True)
            if output.finish_reason is not None:
                print("finished:", output.finish_reason.openai_name, output.error or "")
                return 0 if output.error is None else 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
