"""Run SpikingJelly's own example scripts and model files as drop-ins for spikefuse.

Usage::

    pip install --no-deps --target /tmp/sjpkg spikingjelly==2.0.0
    PYTHONPATH=src python scripts/sj_dropin.py /tmp/sjpkg [--unit NAME ...]

The argument is a SpikingJelly source tree: the folder that holds the ``spikingjelly``
package (a pip ``--target`` folder or a clone of its repository). For every unit of
``sj_dropin_units.UNITS`` (a file of SpikingJelly's ``activation_based/examples`` or
``activation_based/model``, and the models it defines), the harness

1. imports the original file from that tree and builds its model(s) in float64;
2. loads the same file again with only its import lines rewritten
   (``spikingjelly.activation_based`` -> ``spikefuse``, ``spikingjelly.datasets`` ->
   ``spikefuse.datasets``; relative imports are resolved first, so ``from .. import layer``
   in a model file becomes ``from spikefuse import layer``), builds the same model(s) and
   loads SpikingJelly's initial ``state_dict`` into them;
3. runs two SGD training steps (momentum 0.9) on seeded synthetic input in both, resetting
   the network after each, and compares outputs, gradients and updated parameters;
4. prints one row per model: unit, whether it runs on SpikingJelly, whether it runs on
   spikefuse, the largest absolute difference, and the first missing name (or the error).

**This executes the Python files it is pointed at**: that is its purpose. It reads only local
files under the given tree, never anything from the network; point it only at a tree you
trust, as you would before running its scripts yourself. Third-party packages an example
imports but the comparison never calls (torchvision, tensorboard, gym, ...) are replaced, for
the run only and only when missing, by inert stand-in modules (:func:`stand_ins`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

F64 = torch.float64
SJ_ROOT_PACKAGE = "spikingjelly.activation_based"
RENAMES = (
    ("spikingjelly.activation_based", "spikefuse"),
    ("spikingjelly.datasets", "spikefuse.datasets"),
)
# Imported by examples for data, logging or environments the comparison never touches.
OPTIONAL_PACKAGES = (
    "torchvision",
    "torchaudio",
    "tensorboard",
    "tensorboardX",
    "torch.utils.tensorboard",
    "gym",
    "sklearn",
    "lightning",
    "cupy",
)
MATCH_TOLERANCE = 1e-9


# ---- import rewriting ---------------------------------------------------------------------------
def renamed(module: str) -> str | None:
    """``module`` with SpikingJelly's prefix replaced by spikefuse's, or None if not SJ's."""
    for old, new in RENAMES:
        if module == old or module.startswith(old + "."):
            return new + module[len(old) :]
    return None


def _absolute(node: ast.ImportFrom, package: str | None) -> str:
    if not node.level:
        return node.module or ""
    if not package:
        raise ImportError(f"relative import on line {node.lineno} outside a package")
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _names(node: ast.Import | ast.ImportFrom) -> str:
    return ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)


def _rewritten(node: ast.stmt, package: str | None) -> str | None:
    if isinstance(node, ast.ImportFrom):
        target = renamed(_absolute(node, package))
        return None if target is None else f"from {target} import {_names(node)}"
    if isinstance(node, ast.Import):
        aliases = [(renamed(a.name), a) for a in node.names]
        if all(new is None for new, _ in aliases):
            return None
        parts = [(new or a.name) + (f" as {a.asname}" if a.asname else "") for new, a in aliases]
        return "import " + ", ".join(parts)
    return None


def rewrite_imports(source: str, package: str | None) -> str:
    """``source`` with every import of SpikingJelly's ``activation_based`` or ``datasets``
    (absolute, or relative to ``package``) pointed at spikefuse; nothing else changes, and line
    numbers are kept so tracebacks point at the original lines."""
    lines = source.splitlines(keepends=True)
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import | ast.ImportFrom)]
    for node in sorted(nodes, key=lambda n: n.lineno, reverse=True):
        new = _rewritten(node, package)
        if new is None:
            continue
        assert node.end_lineno is not None and node.end_col_offset is not None
        first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
        text = first[: node.col_offset] + new + last[node.end_col_offset :]
        padding = ["\n"] * (node.end_lineno - node.lineno)
        lines[node.lineno - 1 : node.end_lineno] = [text, *padding]
    return "".join(lines)


# ---- stand-ins for optional third-party packages --------------------------------------------------
class _StandIn(types.ModuleType):
    """A module whose every attribute is an inert class (subclassable, callable, ignored)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def stand_ins(names: tuple[str, ...] = OPTIONAL_PACKAGES) -> Iterator[tuple[str, ...]]:
    """Inert modules for those of ``names`` that cannot be imported, until the block ends
    (then they and every module imported from them are removed from ``sys.modules``)."""
    missing = tuple(n for n in names if not _importable(n))
    finder = _StandInFinder(missing)
    sys.meta_path.insert(0, finder)
    try:
        yield missing
    finally:
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if isinstance(sys.modules[m], _StandIn)]:
            del sys.modules[name]


# ---- loading the two versions of a unit ---------------------------------------------------------
@dataclass(frozen=True)
class Side:
    """One library's view of a unit: its loaded file and its package root."""

    name: str  # "spikingjelly" or "spikefuse"
    module: types.ModuleType
    root: str  # SJ_ROOT_PACKAGE or "spikefuse"

    def sub(self, name: str) -> Any:
        """The library's submodule ``name`` (``neuron``, ``functional``, ...)."""
        return importlib.import_module(f"{self.root}.{name}")


def load_unit(sj_root: Path, relpath: str, dropin: bool) -> Side:
    """The file ``relpath`` under the tree's ``activation_based/``, executed as a fresh module:
    as it is (``dropin=False``, its relative imports resolved in SpikingJelly's package) or
    with its imports rewritten (see the module docstring: this runs the local file's code)."""
    dotted = f"{SJ_ROOT_PACKAGE}.{relpath.removesuffix('.py').replace('/', '.')}"
    package, stem = dotted.rsplit(".", 1)
    path = sj_root / SJ_ROOT_PACKAGE.replace(".", "/") / relpath
    source = path.read_text(encoding="utf-8")
    name = f"sj_dropin_{'spikefuse' if dropin else 'original'}.{stem}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    if dropin:
        source = rewrite_imports(source, package)
    else:
        module.__package__ = package
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102  # the purpose
    if dropin:
        return Side("spikefuse", module, "spikefuse")
    return Side("spikingjelly", module, SJ_ROOT_PACKAGE)


# ---- two training steps ---------------------------------------------------------------------------
Build = Callable[[Side], torch.nn.Module]
Forward = Callable[[Side, torch.nn.Module, torch.Tensor], Any]


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [t for item in out for t in _tensors(item)]
    return []


def _loss(outputs: list[torch.Tensor]) -> torch.Tensor:
    """A fixed random projection of every output: the same on both sides."""
    g = torch.Generator().manual_seed(1234)
    terms = [(o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outputs]
    return torch.stack(terms).sum()


def train_two_steps(
    side: Side, net: torch.nn.Module, x: torch.Tensor, forward: Forward
) -> list[dict[str, torch.Tensor]]:
    """Per step: outputs, gradients and updated parameters (by name)."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    records = []
    for step in range(2):
        torch.manual_seed(100 + step)  # the same dropout masks, encoder spikes, ...
        optimizer.zero_grad()
        outputs = _tensors(forward(side, net, x))
        if not outputs:
            raise RuntimeError("the forward returned no tensor")
        _loss(outputs).backward()
        optimizer.step()
        side.sub("functional").reset_net(net)
        record = {f"out{i}": o.detach().clone() for i, o in enumerate(outputs)}
        for name, p in net.named_parameters():
            if p.grad is not None:
                record[f"grad:{name}"] = p.grad.detach().clone()
            record[f"param:{name}"] = p.detach().clone()
        records.append(record)
    return records


def max_difference(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> float:
    """The largest difference over every recorded tensor, each relative to its largest
    magnitude when that exceeds 1 (gradients of deep nets reach 1e4); inf if they differ in
    names or shapes (a NaN on one side only also counts as inf)."""
    worst = 0.0
    for ra, rb in zip(a, b, strict=True):
        if ra.keys() != rb.keys():
            return float("inf")
        for key, ta in ra.items():
            tb = rb[key]
            if ta.shape != tb.shape or not torch.equal(ta.isnan(), tb.isnan()):
                return float("inf")
            if ta.numel():
                scale = max(1.0, ta.abs().nan_to_num(0.0).max().item())
                worst = max(worst, (ta - tb).abs().nan_to_num(0.0).max().item() / scale)
    return worst


# ---- describing failures --------------------------------------------------------------------------
def missing_name(exc: BaseException) -> str | None:
    """The dotted name an ImportError or AttributeError says is missing, if it says one."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return exc.name
    if isinstance(exc, ImportError) and exc.name and "cannot import name" in str(exc):
        return f"{exc.name}.{str(exc).split(chr(39))[1]}"
    if isinstance(exc, AttributeError) and isinstance(getattr(exc, "obj", None), types.ModuleType):
        return f"{exc.obj.__name__}.{exc.name}"  # type: ignore[attr-defined]
    return None


def describe(exc: BaseException) -> str:
    """``missing: NAME`` for a missing name, else the error and the line that raised it."""
    name = missing_name(exc)
    if name is not None:
        return f"missing: {name}"
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"[:160]


def unresolved_names(side: Side) -> list[str]:
    """``module.attr`` references in the loaded file to spikefuse modules that lack ``attr``
    (found before anything is built, so import-only units still name what they need)."""
    path = Path(side.module.__file__ or "")
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = side.module.__dict__.get(node.value.id)
            if isinstance(owner, types.ModuleType) and owner.__name__.startswith("spikefuse"):
                if not hasattr(owner, node.attr):
                    found.append(f"{owner.__name__}.{node.attr}")
    return sorted(set(found), key=found.index)


# ---- running units --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One line of the table."""

    unit: str
    sj_runs: bool
    sf_runs: bool
    difference: float | None
    cause: str


def _run_side(side: Side, case: Any, state: dict[str, Any] | None) -> tuple[Any, Any]:
    torch.manual_seed(0)
    net = case.build(side).to(case.dtype)
    if state is not None:
        net.load_state_dict(state)
    gen = torch.Generator().manual_seed(7)
    x = torch.rand(case.shape, generator=gen, dtype=case.dtype)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    return initial, train_two_steps(side, net, x, case.forward)


def _attempt(load: Callable[[], Side]) -> tuple[Side | None, str]:
    try:
        return load(), ""
    except Exception as exc:  # noqa: BLE001  # any failure of foreign code is a result
        return None, describe(exc)


def run_unit(sj_root: Path, unit: Any) -> list[Row]:
    """The rows of one unit: one per model, or one for an import-only unit."""
    with stand_ins():
        original, sj_error = _attempt(lambda: load_unit(sj_root, unit.relpath, dropin=False))
        dropin, sf_error = _attempt(lambda: load_unit(sj_root, unit.relpath, dropin=True))
        if dropin is not None and not sf_error:
            unresolved = unresolved_names(dropin)
            sf_error = f"missing: {unresolved[0]}" if unresolved else ""
        if not unit.cases:
            note = f"SJ: {sj_error}" if sj_error else (sf_error or unit.note)
            return [
                Row(
                    unit.relpath,
                    original is not None,
                    not sf_error and dropin is not None,
                    None,
                    note,
                )
            ]
        return [_run_case(unit, case, original, dropin, sj_error, sf_error) for case in unit.cases]


def _run_case(
    unit: Any, case: Any, original: Side | None, dropin: Side | None, sj_error: str, sf_error: str
) -> Row:
    label = f"{unit.relpath}:{case.label}"
    theirs = ours = None
    if original is not None:
        try:
            state, theirs = _run_side(original, case, None)
        except Exception as exc:  # noqa: BLE001
            sj_error = describe(exc)
    if dropin is not None and theirs is not None:
        try:
            _, ours = _run_side(dropin, case, state)
        except Exception as exc:  # noqa: BLE001
            sf_error = sf_error or describe(exc)
    difference = max_difference(theirs, ours) if theirs and ours else None
    cause = (
        sf_error
        if ours is None
        else ("" if difference is not None and difference <= MATCH_TOLERANCE else "outputs differ")
    )
    if theirs is None:
        cause = f"SJ: {sj_error}"
    return Row(label, theirs is not None, ours is not None, difference, cause)


def table(rows: list[Row]) -> str:
    """The Markdown table of ``rows``."""
    lines = [
        "| unit | runs on SJ | runs on spikefuse | max difference | first missing name / cause |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        diff = "" if r.difference is None else f"{r.difference:.1e}"
        lines.append(
            f"| {r.unit} | {'yes' if r.sj_runs else 'no'} | {'yes' if r.sf_runs else 'no'} | {diff} | {r.cause} |"
        )
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """Counts: rows whose original runs, and of those the drop-ins that run and match."""
    run = [r for r in rows if r.sj_runs]
    match = [r for r in run if r.sf_runs and not r.cause]
    return (
        f"{len(match)} of {len(run)} rows whose original runs are drop-ins (run and match within "
        f"{MATCH_TOLERANCE:g}); {len(rows)} rows in all"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sj_root", type=Path, help="folder holding the spikingjelly package")
    parser.add_argument(
        "--unit", action="append", default=[], help="run only units whose path contains this"
    )
    args = parser.parse_args(argv)
    if not (args.sj_root / "spikingjelly" / "activation_based").is_dir():
        parser.error(f"{args.sj_root} has no spikingjelly/activation_based folder")
    sys.path.insert(0, str(args.sj_root.resolve()))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sj_dropin_units import UNITS

    torch.set_default_dtype(F64)
    units = [u for u in UNITS if not args.unit or any(s in u.relpath for s in args.unit)]
    rows = [row for unit in units for row in run_unit(args.sj_root, unit)]
    version = importlib.metadata.version("spikingjelly") if _has_dist() else "unknown"
    print(f"SpikingJelly {version} from {args.sj_root}\n")
    print(table(rows))
    print("\n" + summary(rows))
    return 0


def _has_dist() -> bool:
    try:
        importlib.metadata.version("spikingjelly")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
