"""`jackfield doctor [--config FILE]`: check a config against the installed plugins and this
machine without loading a model. Exit 0 with the resolved choices, or 2 with every problem."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from jackfield.config import JackfieldConfig, load_config, unsupported_features
from jackfield.model_files import read_config_json
from jackfield.plugins import Registry, get_registry
from jackfield.requirements import attention_requirements
from jackfield.selection import SelectionError, resolve_attention, select_attention_backend

USER_ERROR_EXIT = 2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("doctor", help="validate a config without loading a model")
    parser.add_argument("--config", help="a jackfield TOML file (default: built-in defaults)")
    parser.add_argument("--model", help="override [model].path")
    parser.set_defaults(handler=main)


def _model_hf_config(config: JackfieldConfig) -> Mapping[str, object]:
    if config.model.path is not None:
        return read_config_json(config.model.path)
    from jackfield.models.default_model import default_hf_config

    return default_hf_config()


def _check_named(registry: Registry, kind: str, name: str | None, key: str) -> list[str]:
    if name is None:
        return []
    try:
        registry.lookup(kind, name)
    except KeyError as exc:
        return [f"{key}: {exc.args[0]}"]
    return []


def diagnose(config: JackfieldConfig, registry: Registry) -> tuple[list[str], list[str]]:
    """(resolved choices, problems) for `config` on this machine."""
    problems: list[str] = []
    resolved: list[str] = []
    problems += _check_named(registry, "sampler", config.sampler.name, "sampler.name")
    problems += _check_named(registry, "drafter", config.speculative.method, "speculative.method")
    problems += _check_named(registry, "kv_connector", config.kv_connector.name, "kv_connector.name")
    problems += unsupported_features(config)
    try:
        hf_config = _model_hf_config(config)
        architectures = list(hf_config.get("architectures") or [])  # type: ignore[call-overload]
        known = [a for a in architectures if a in registry.entries["model"]]
        if not known:
            problems.append(
                f"model architectures {architectures} are not registered; "
                f"registered: {', '.join(registry.names('model'))}"
            )
        else:
            resolved.append(f"model: {known[0]} ({config.model.path or 'embedded default'})")
        requirements = attention_requirements(hf_config, config)
        dtype_name = str(requirements.dtype).removeprefix("torch.")
        resolved.append(f"device: {requirements.device}, dtype: {dtype_name}")
        for role, choice in resolve_attention(config, requirements).items():
            resolved.append(f"attention[{role}]: {choice.name} - {choice.reason}")
            for name, reasons in sorted(choice.rejected.items()):
                resolved.append(f"    rejected {name}: {'; '.join(reasons)}")
        if config.attention.drafter_backend is not None:
            drafter = select_attention_backend(requirements, config.attention.drafter_backend, "drafter")
            resolved.append(f"attention[drafter]: {drafter.name} - {drafter.reason}")
    except (SelectionError, FileNotFoundError, ValueError, KeyError) as exc:
        problems.append(str(exc))
    if not problems:
        resolved.append(f"sampler: {config.sampler.name}")
    return resolved, problems


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
