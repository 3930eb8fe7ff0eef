"""Offline batch inference over an OpenAI Batch API .jsonl file: exactly `jaxserve batch`, for
those who run the scripts in tools/ directly.

    python tools/batch_infer.py --model smollm2-135m-instruct \
        --input requests.jsonl --output results.jsonl [engine flags]
"""

import sys

from jaxserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["batch", *sys.argv[1:]]))
