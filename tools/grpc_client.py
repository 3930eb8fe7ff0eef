"""Stream one generation from a running jaxserve gRPC server.

    python tools/grpc_client.py --target 127.0.0.1:50051 --model smollm2-135m-instruct \
        --prompt "The capital of France is" --max-tokens 32
"""

import argparse
import sys

from jaxserve.entrypoints.client import Client


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=60.0, help="request deadline, seconds")
    args = p.parse_args()
    with Client(args.target) as client:
        for delta in client.generate(args.model, args.prompt, timeout=args.timeout,
                                     max_tokens=args.max_tokens, temperature=args.temperature):
            print(delta.text, end="", flush=True)
            if delta.finish_reason:
                print(f"\n[{delta.finish_reason}: {delta.usage.prompt_tokens} prompt + "
                      f"{delta.usage.completion_tokens} completion tokens]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
