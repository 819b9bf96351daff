"""`jackfield doctor [--config FILE]`: check a config against the installed plugins and this
machine without loading a model. Exit 0 with the resolved choices, or 2 with every problem."""

from __future__ import annotations

import argparse

from jackfield.config import JackfieldConfig, load_config
from jackfield.plugins import Registry, get_registry
from jackfield.preflight import model_hf_config, prefix_cache_note, preflight, tokenizer_note
from jackfield.requirements import attention_requirements

USER_ERROR_EXIT = 2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("doctor", help="validate a config without loading a model")
    parser.add_argument("--config", help="a jackfield TOML file (default: built-in defaults)")
    parser.add_argument("--model", help="override [model].path")
    parser.set_defaults(handler=main)


def diagnose(config: JackfieldConfig, registry: Registry) -> tuple[list[str], list[str]]:
    """(resolved choices and notes, problems) for `config` on this machine. The problems are
    exactly those the Engine raises before loading (`preflight`), so doctor OK means run starts."""
    checked = preflight(config, registry)
    if checked.problems:
        return [], checked.problems
    assert checked.attention is not None  # no problems: selection succeeded
    hf_config = model_hf_config(config)
    architectures = list(hf_config.get("architectures") or [])  # type: ignore[call-overload]
    known = [a for a in architectures if a in registry.entries["model"]]
    resolved = [f"model: {known[0]} ({config.model.path or 'embedded default'})"]
    requirements = attention_requirements(hf_config, config)
    dtype_name = str(requirements.dtype).removeprefix("torch.")
    resolved.append(f"device: {requirements.device}, dtype: {dtype_name}")
    for role, choice in checked.attention.items():
        resolved.append(f"attention[{role}]: {choice.name} - {choice.reason}")
        for name, reasons in sorted(choice.rejected.items()):
            resolved.append(f"    rejected {name}: {'; '.join(reasons)}")
    if checked.kv_scales is not None:
        plan = checked.kv_scales
        resolved.append(f"kv cache: fp8_e4m3, scales ({plan.source}): {plan.detail}")
    resolved.append(f"sampler: {config.sampler.name}")
    speculative = config.speculative
    if speculative.method is not None:  # preflight found it registered
        drafter = registry.entries["drafter"][speculative.method]
        draft = f", draft {speculative.model}" if speculative.model else ""
        resolved.append(f"speculative: {speculative.method}, k = {speculative.num_speculative_tokens}{draft} "
                        f"({drafter.distribution})")
    for note in (tokenizer_note(config), prefix_cache_note(config, hf_config)):
        if note is not None:
            resolved.append(f"note: {note}")
    return resolved, []


def main(args: argparse.Namespace) -> int:
    overrides = {"model.path": args.model} if args.model is not None else {}
    config = load_config(args.config, overrides)
    resolved, problems = diagnose(config, get_registry())
    if problems:
        print(f"{args.config or '<defaults>'}: {len(problems)} problem(s):")
        for problem in problems:
            print("  - " + problem.replace("\n", "\n    "))
        return USER_ERROR_EXIT
    print(f"{args.config or '<defaults>'}: OK")
    for line in resolved:
        print("  " + line)
    return 0
