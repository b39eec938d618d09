"""User reward functions: loading by name, a check before training, and a run-time
wrapper whose errors name the function and the row.

The contract of a reward function::

    def reward(prompt: str, response: str, answer: str) -> float: ...

It returns a real number (``int``, ``float``, ``bool`` as 0/1, numpy scalars, or any
``numbers.Real``), finite; NaN, infinities, complex numbers, tensors and other types are
errors. Built-in verifiers (:mod:`.verifiers`) keep the same contract, so
:func:`resolve_reward` takes either a verifier's name or a ``module:function`` path.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from nereus_rl.data.verifiers import VERIFIERS

RewardFn = Callable[[str, str, str], float]


class RewardFnError(ValueError):
    """A reward function cannot be loaded, fails its check, or fails while scoring; the
    message names the function (and, while scoring, the row)."""


class RewardRuntimeError(RewardFnError):
    """A reward function raised or returned a non-number while scoring a row.

    Attributes:
        fn_name: the function's name.
        where: the row (``"FILE:LINE"``, ``"FILE: row N"`` or ``"batch item I"``).
    """

    def __init__(self, message: str, fn_name: str, where: str) -> None:
        super().__init__(message)
        self.fn_name = fn_name
        self.where = where


def reward_fn_name(fn: Callable) -> str:
    """A readable name of ``fn`` for messages: its spec if it was loaded by name, else
    ``module.qualname``."""
    if isinstance(fn, RewardFunction):
        return fn.name
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qualname}" if module else qualname


def _as_reward(value: object) -> float | None:
    """``value`` as a finite float, or None when it is not a finite real number."""
    # numbers.Real covers int, float, bool, Fraction and numpy's scalars, not complex,
    # Decimal or tensors.
    if not isinstance(value, numbers.Real):
        return None
    out = float(value)
    return out if math.isfinite(out) else None


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    hint = " (call .item() on a tensor or array)" if hasattr(value, "item") else ""
    return f"{type(value).__name__} {text}{hint}"


class RewardFunction:
    """A reward function with a name for messages; calling it checks every result.

    Made by :func:`load_reward_fn`, :func:`resolve_reward` or :func:`wrap_reward_fn`. One
    loaded by name pickles as its name and is loaded again on the other side, so it can
    cross to worker processes even when it came from a file.

    Attributes:
        fn: the callable ``fn(prompt, response, answer)``.
        name: its name in messages.
        spec: what :func:`resolve_reward` loads it from again (for pickling), if any.
    """

    def __init__(self, fn: Callable[..., object], name: str, spec: str | None = None) -> None:
        self.fn = fn
        self.name = name
        self.spec = spec

    def __repr__(self) -> str:
        return f"RewardFunction({self.name!r})"

    def __reduce__(self):
        if self.spec is not None:
            return (resolve_reward, (self.spec,))
        return (RewardFunction, (self.fn, self.name, None))

    def __call__(self, prompt: str, response: str, answer: str, *, where: str = "") -> float:
        """The reward of one response, as a finite float.

        Arguments:
            prompt, response, answer: the reward function's arguments.
            where: the row being scored, for messages.

        Raises:
            RewardRuntimeError: the function raised or returned something other than a
                finite real number; the message names the function and ``where``, and
                the function's own exception is the ``__cause__``.
        """
        at = where or "a row"
        try:
            value = self.fn(prompt, response, answer)
        except Exception as e:
            raise RewardRuntimeError(
                f"reward function {self.name!r} raised {type(e).__name__} on {at}: {e}",
                self.name,
                at,
            ) from e
        reward = _as_reward(value)
        if reward is None:
            raise RewardRuntimeError(
                f"reward function {self.name!r} returned {_describe(value)} on {at}; it "
                "must return a finite real number",
                self.name,
                at,
            )
        return reward

    def score(self, problems: Sequence[object], responses: Sequence[str]) -> list[float]:
        """Rewards of a batch: ``responses[i]`` against ``problems[i]`` (anything with
        ``prompt`` and ``answer``; a :class:`~nereus_rl.data.datasets.PromptExample`'s
        ``where`` names its row in errors).

        Raises:
            ValueError: the two lengths differ.
            RewardRuntimeError: as :meth:`__call__`.
        """
        if len(problems) != len(responses):
            raise ValueError(f"{len(problems)} problems but {len(responses)} responses")
        return [
            self(p.prompt, r, p.answer, where=getattr(p, "where", "") or f"batch item {i}")
            for i, (p, r) in enumerate(zip(problems, responses))
        ]


def wrap_reward_fn(fn: Callable[..., object], name: str | None = None) -> RewardFunction:
    """``fn`` as a :class:`RewardFunction` (returned as is if it already is one).

    Raises:
        RewardFnError: ``fn`` is not callable.
    """
    if isinstance(fn, RewardFunction):
        return fn
    if not callable(fn):
        raise RewardFnError(f"reward function {name or fn!r} is not callable")
    return RewardFunction(fn, name or reward_fn_name(fn))


def _check_signature(fn: Callable[..., object], name: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins and C callables have no signature to check
    try:
        sig.bind("prompt", "response", "answer")
    except TypeError:
        raise RewardFnError(
            f"reward function {name!r} cannot be called as fn(prompt, response, answer): "
            f"its signature is {sig}"
        ) from None


def _split_spec(spec: str) -> tuple[str, list[str]]:
    target, sep, attr = spec.rpartition(":")
    parts = attr.split(".")
    if not sep or not target or not all(p.isidentifier() for p in parts):
        raise RewardFnError(
            f"reward function {spec!r}: expected 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    return target, parts


def _is_file_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _import_file(path: Path, spec: str) -> ModuleType:
    if not path.is_file():
        raise RewardFnError(f"reward function {spec!r}: no such file {str(path)!r}")
    # One module per file (keyed by its absolute path): loading twice reuses it, and two
    # files with one stem do not collide.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    mod_name = f"_nereus_reward_{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    mspec = importlib.util.spec_from_file_location(mod_name, path)
    if mspec is None or mspec.loader is None:
        raise RewardFnError(f"reward function {spec!r}: cannot import {str(path)!r}")
    module = importlib.util.module_from_spec(mspec)
    # Registered before running it, as an import does, so dataclasses and pickling inside
    # the file find their module.
    sys.modules[mod_name] = module
    try:
        mspec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[mod_name]
        if not isinstance(e, Exception):
            raise
        raise RewardFnError(
            f"reward function {spec!r}: importing {str(path)!r} raised {type(e).__name__}: {e}"
        ) from e
    return module


def _import_module(name: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # Only a missing target module is "not found"; a missing import inside it is the
        # module's own error.
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise RewardFnError(
                f"reward function {spec!r}: no module named {e.name!r} (is its folder on "
                "PYTHONPATH? a file can be named as 'path/to/file.py:function')"
            ) from None
        raise RewardFnError(
            f"reward function {spec!r}: importing {name!r} raised ModuleNotFoundError: {e}"
        ) from e
    except Exception as e:
        raise RewardFnError(
            f"reward function {spec!r}: importing {name!r} raised {type(e).__name__}: {e}"
        ) from e


def load_reward_fn(spec: str) -> RewardFunction:
    """Import a reward function by ``"package.module:function"`` or
    ``"path/to/file.py:function"`` (a relative path is resolved against the current
    folder; ``function`` may be dotted, ``Class.method``).

    A file is imported as a module of its own; it can import installed packages, and
    modules beside it only when their folder is on ``sys.path``.

    Returns:
        The function as a :class:`RewardFunction` named ``spec``.

    Raises:
        RewardFnError: a malformed spec, a missing module, file or attribute, an import
            that raises, something not callable, or a signature that does not take
            ``(prompt, response, answer)``; the message names ``spec``.
    """
    target, attrs = _split_spec(spec)
    if _is_file_target(target):
        path = Path(target).expanduser().resolve()
        module = _import_file(path, spec)
        canonical = f"{path}:{'.'.join(attrs)}"
    else:
        module = _import_module(target, spec)
        canonical = spec
    obj: object = module
    for i, attr in enumerate(attrs):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            owner = ".".join([target, *attrs[:i]]) if i else target
            raise RewardFnError(
                f"reward function {spec!r}: {owner!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise RewardFnError(f"reward function {spec!r} is {type(obj).__name__}, not a callable")
    _check_signature(obj, spec)
    return RewardFunction(obj, spec, canonical)


def resolve_reward(spec: str) -> RewardFunction:
    """A built-in verifier by name (``"exact"``, ``"numeric"``, ``"format"``) or a user
    function by ``"module:function"`` / ``"path/to/file.py:function"``.

    Raises:
        RewardFnError: as :func:`load_reward_fn`, or a name that is neither a verifier
            nor a ``module:function`` path.
    """
    if spec in VERIFIERS:
        return RewardFunction(VERIFIERS[spec], f"verifier {spec}", spec)
    if ":" not in spec:
        raise RewardFnError(
            f"reward {spec!r} is not a built-in verifier ({', '.join(sorted(VERIFIERS))}) "
            "nor a 'module:function' or 'path/to/file.py:function'"
        )
    return load_reward_fn(spec)


def check_reward_fn(
    fn: Callable[..., object],
    sample_prompt: str,
    sample_answer: str,
    *,
    sample_response: str | None = None,
) -> float:
    """Call ``fn`` once on a sample, before training, and check the result.

    Arguments:
        fn: a reward function (a plain callable or a :class:`RewardFunction`).
        sample_prompt: a prompt from the dataset.
        sample_answer: its ground truth.
        sample_response: the response to score; default ``sample_answer`` (a response
            that states the answer), which any reward function must be able to score.

    Returns:
        The reward, as a float.

    Raises:
        RewardFnError: ``fn`` is not callable, does not take ``(prompt, response,
            answer)``, raises on the sample, or returns something other than a finite
            real number (``bool`` counts as 0/1); the message names the function.
    """
    rf = wrap_reward_fn(fn)
    _check_signature(rf.fn, rf.name)
    response = sample_answer if sample_response is None else sample_response
    try:
        return rf(sample_prompt, response, sample_answer, where="a sample row")
    except RewardRuntimeError as e:
        # The same message, as a check failure rather than a failure mid-run.
        raise RewardFnError(f"{e} (checked before training)") from e.__cause__
