"""The ``grpo`` argument parser: registry names written out in full, one-line usage on errors.

A config may select the loss or the sampler by its registry name (``model.loss: dapo``,
``data.sampler: hf_generate``). jsonargparse keeps such a name as the string it was given, so
without help ``--print_config``, the saved ``config.yaml`` and the MLflow params would hold
``dapo`` and none of its knobs (``epsilon``, ``beta``, ...). :func:`expand_component_names`
replaces a name by the ``class_path`` + ``init_args`` that jsonargparse builds for that class, the
same spec a config giving the class path parses to; the parser applies it to everything it dumps
(``--print_config``, ``config.yaml``, MLflow) and the CLI to the config it instantiates. The
parser also expands names as it reads the command line and config files, so that a component
given by name takes knob overrides (``--model.loss.init_args.beta``).
"""

from __future__ import annotations

import importlib
import sys
from typing import IO, Any, Mapping, Optional

from jsonargparse import ArgumentParser, Namespace
from lightning.pytorch.cli import LightningArgumentParser

from grpo_lightning.losses import LOSSES, PolicyLoss
from grpo_lightning.samplers import SAMPLERS, Sampler

#: Config key -> (base class, registry of short names). A registry maps a name to its class or to
#: the dotted path of its class.
COMPONENTS: dict[str, tuple[type, Mapping[str, Any]]] = {
    "model.loss": (PolicyLoss, LOSSES),
    "data.sampler": (Sampler, SAMPLERS),
}


def _class_path(entry: Any) -> str:
    """The shortest import path of a registry entry (a class or its dotted path): the one a user writes.

    >>> _class_path("grpo_lightning.losses.clipped.DAPOLoss")
    'grpo_lightning.losses.DAPOLoss'
    """
    if isinstance(entry, str):
        module_name, _, name = entry.rpartition(".")
        entry = getattr(importlib.import_module(module_name), name)
    parts = entry.__module__.split(".")
    for end in range(1, len(parts) + 1):  # shortest first: the package that exports it
        module = sys.modules.get(".".join(parts[:end]))
        if module is not None and getattr(module, entry.__qualname__, None) is entry:
            return f"{module.__name__}.{entry.__qualname__}"
    return f"{entry.__module__}.{entry.__qualname__}"


def component_spec(base: type, class_path: str) -> Namespace:
    """``class_path`` with every ``init_args`` default, as a config giving that class path parses."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--component", type=Optional[base])
    return parser.parse_object({"component": {"class_path": class_path}}).component


def expand_component_names(config: Namespace) -> Namespace:
    """A copy of ``config`` in which a loss or sampler given by registry name is its full spec.

    Unknown names stay as given, so the component's own check reports them with the valid names.
    """
    expanded = config
    for key, (base, registry) in COMPONENTS.items():
        value = config.get(key) if isinstance(config, Namespace) else None
        if isinstance(value, str) and value in registry:
            if expanded is config:
                expanded = config.clone()
            expanded[key] = component_spec(base, _class_path(registry[value]))
    return expanded


def expand_component_arguments(argv: list[str]) -> list[str]:
    """``argv`` with a registry name given on the command line (``--model.loss grpo``,
    ``--data.sampler=fast_generate``) replaced by its class path, so that later arguments can set
    its knobs (``--model.loss.init_args.beta 0.04``): the class, tried before ``str`` in the
    setting's union, parses the path to the same spec.

    >>> expand_component_arguments(["fit", "--model.loss", "grpo", "--data.sampler=nope"])
    ['fit', '--model.loss', 'grpo_lightning.losses.GRPOLoss', '--data.sampler=nope']
    """
    out = list(argv)
    for i, arg in enumerate(out):
        for key, (_, registry) in COMPONENTS.items():
            flag = f"--{key}"
            if arg == flag and i + 1 < len(out) and out[i + 1] in registry:
                out[i + 1] = _class_path(registry[out[i + 1]])
            elif arg.startswith(flag + "=") and arg[len(flag) + 1 :] in registry:
                out[i] = f"{flag}={_class_path(registry[arg[len(flag) + 1 :]])}"
    return out


class GRPOArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` that dumps registry names in full and keeps errors short."""

    def dump(self, namespace: Namespace, *args: Any, **kwargs: Any) -> str:
        return super().dump(expand_component_names(namespace), *args, **kwargs)

    # Names are expanded as the command line and each config file are read, so that later
    # arguments can set the component's knobs: `--config quickstart.yaml --model.loss.init_args.beta
    # 0.04` with `loss: dapo` in the file (jsonargparse cannot set init_args on a plain string).
    def parse_args(self, args: Any = None, *rest: Any, **kwargs: Any) -> Namespace:
        if args is None or isinstance(args, list):
            args = expand_component_arguments(sys.argv[1:] if args is None else args)
        return super().parse_args(args, *rest, **kwargs)

    def parse_path(self, *args: Any, **kwargs: Any) -> Namespace:
        return expand_component_names(super().parse_path(*args, **kwargs))

    def parse_string(self, *args: Any, **kwargs: Any) -> Namespace:
        return expand_component_names(super().parse_string(*args, **kwargs))

    def print_usage(self, file: IO[str] | None = None) -> None:
        # jsonargparse prints the usage before every parse error: ~100 lines of options for
        # `grpo fit`, hiding the one line that matters. The error's own tip points to --help.
        (file or sys.stdout).write(f"usage: {self.prog} [--config CONFIG] [options]\n")
