"""`jaxserve policy check FILE`: load a policy file as `serve --policy` will, and summarise it."""

from __future__ import annotations

from pathlib import Path

from jaxserve.safety.policy import load_policy


def cmd_check(args) -> int:
    policy = load_policy(args.file)
    try:
        for pack in policy.packs.values():
            print(f"pack {pack.name}: {len(pack.rules)} rule(s), max_prompt_chars "
                  f"{pack.max_prompt_chars or 'none'}, max_holdback_chars "
                  f"{pack.max_holdback_chars}")
            for rule in pack.rules:
                print(f"  {rule.name}: {rule.stage} {rule.match} -> {rule.action}")
    finally:
        policy.close()
    return 0


def add_policy_command(sub) -> None:
    p = sub.add_parser("policy", help="check a policy file (serve --policy FILE)")
    commands = p.add_subparsers(dest="policy_command", required=True)
    c = commands.add_parser("check", help="load the file (regexes compiled, classifiers built) "
                                          "and list its packs and rules; exit 1 naming the "
                                          "first error")
    c.add_argument("file", type=Path)
    c.set_defaults(func=cmd_check)
