"""Rebuild ``miles_flags.txt``: every flag miles' ``train.py`` accepts on the Megatron backend, with its file.

miles parses its command line with Megatron-LM's ``parse_args(extra_args_provider=...)``, so the
accepted flags are Megatron-LM's (``megatron/training/arguments.py``, part of them generated from
config dataclasses by ``megatron/training/argument_utils.py``) plus miles' own
(``get_miles_extra_args_provider`` in ``miles/utils/arguments.py`` and the files it calls).
This script builds that real parser from two source checkouts and writes one line per flag:
``FLAG<TAB>NARGS<TAB>FILE`` (``NARGS`` is ``0`` for switches, ``1`` for one value, ``+``/``*``/``N``
otherwise; ``FILE`` is the file whose code registered it).

SGLang's server flags reach miles as ``--sglang-<ServerArgs flag>``; they are generated at run time
from the installed SGLang, so they are not listed here (``tests/examples`` checks them against
``ServerArgs`` where SGLang is importable). Third-party modules the parser does not need (ray,
sglang, polars, ...) are replaced by empty stand-ins while importing.

Usage (with the repos at the commits named in the header it writes)::

    python examples/miles/refresh_miles_flags.py --miles /path/to/miles --megatron /path/to/Megatron-LM \
        --miles-ref "radixark/miles@<sha>" --megatron-ref "radixark/Megatron-LM@<sha>"
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "miles_flags.txt"

# Flags our scripts pass that the miles commit this list is built from (radixark/miles PR #1792, the
# native-LoRA branch docs/miles.md pins) does not define itself; each names what defines it at run time.
NEWER_MAIN = {
    "--rollout-top-logprobs-num": (
        "1",
        "kimi_rl_glue: kimi_rl_glue/miles/topk_rollout.py add_arguments (miles' parser calls it for "
        "--custom-generate-function-path kimi_rl_glue.miles.topk_rollout.generate)",
    ),
}


def _collect(miles: Path, megatron: Path, stubs: list[str]) -> dict:
    """Build the parser in this process and return ``{flag: [nargs, file]}``."""

    class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in stubs:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            from unittest import mock

            m = mock.MagicMock(name=spec.name)
            m.__path__, m.__spec__ = [], spec
            return m

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, _Stub())
    sys.path[:0] = [str(miles), str(megatron)]
    roots = [(str(miles.resolve()) + os.sep, ""), (str(megatron.resolve()) + os.sep, "Megatron-LM:")]
    found: dict = {}
    original = argparse._ActionsContainer.add_argument

    def recording_add_argument(self, *names, **kwargs):
        action = original(self, *names, **kwargs)
        frame, where = sys._getframe(1), "argparse (built in)"
        while frame is not None:
            fn = os.path.abspath(frame.f_code.co_filename)
            hit = [tag + fn[len(root) :] for root, tag in roots if fn.startswith(root)]
            if hit:
                where = hit[0]
                break
            frame = frame.f_back
        nargs = action.nargs
        n = "0" if nargs == 0 else ("1" if nargs is None else str(nargs))
        for s in action.option_strings:
            if s.startswith("--"):
                found.setdefault(s, [n, where])
        return action

    argparse._ActionsContainer.add_argument = recording_add_argument
    import megatron.training.arguments as margs
    from miles.utils.arguments import get_miles_extra_args_provider

    sys.argv = ["train.py", "--rollout-batch-size", "1"]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    margs.add_megatron_arguments(parser)
    get_miles_extra_args_provider()(parser)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--miles", type=Path, required=True, help="radixark/miles checkout")
    p.add_argument("--megatron", type=Path, required=True, help="radixark/Megatron-LM checkout (miles-main)")
    p.add_argument("--miles-ref", required=True, help='written into the header, e.g. "radixark/miles@31f1ca9"')
    p.add_argument("--megatron-ref", required=True, help="written into the header")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument(
        "--stub",
        default="six,sglang,sglang_router,polars,ray",
        help="comma list of top-level modules replaced by stand-ins",
    )
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    stubs = [s for s in a.stub.split(",") if s]
    if a._child:
        print(json.dumps(_collect(a.miles, a.megatron, stubs)))
        return 0
    # A child process per attempt: a module missing on this machine is stubbed and the import retried.
    for _ in range(20):
        cmd = [
            sys.executable,
            __file__,
            "--miles",
            str(a.miles),
            "--megatron",
            str(a.megatron),
            "--miles-ref",
            a.miles_ref,
            "--megatron-ref",
            a.megatron_ref,
            "--stub",
            ",".join(stubs),
            "--_child",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0:
            found = json.loads(r.stdout.strip().splitlines()[-1])
            break
        missing = [ln.split("'")[1] for ln in r.stderr.splitlines() if ln.startswith("ModuleNotFoundError")]
        top = missing[0].split(".")[0] if missing else None
        if not top or top in stubs or top in ("megatron", "miles", "miles_megatron_plugins"):
            sys.stderr.write(r.stderr)
            return 1
        stubs.append(top)
    else:
        return 1
    for flag, (n, src) in NEWER_MAIN.items():
        found.setdefault(flag, [n, src])
    lines = [
        "# Flags accepted by miles' train.py (Megatron backend). Generated by examples/miles/refresh_miles_flags.py;",
        "# do not edit by hand. One line per flag: FLAG<TAB>NARGS<TAB>FILE (NARGS 0 = switch, 1 = one value).",
        f"# miles:       {a.miles_ref} (miles/utils/arguments.py get_miles_extra_args_provider and the files it calls)",
        f"# Megatron-LM: {a.megatron_ref} (megatron/training/arguments.py add_megatron_arguments;",
        "#              dataclass-generated groups come from megatron/training/argument_utils.py)",
        "# FILE 'Megatron-LM:...' is in Megatron-LM, a bare path is in miles, 'kimi_rl_glue: ...' is a flag our",
        "# --custom-generate-function-path adds to miles' parser (miles calls its add_arguments).",
        "# Not listed: --sglang-<flag> / --eval-sglang-<flag>, generated from the installed SGLang's",
        "# ServerArgs.add_cli_args by miles/backends/sglang_utils/arguments.py (checked against ServerArgs).",
        f"# modules stubbed while importing: {','.join(stubs)}",
    ]
    lines += [f"{flag}\t{n}\t{src}" for flag, (n, src) in sorted(found.items())]
    a.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(found)} flags to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
