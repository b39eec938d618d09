"""Tokenizers of Hugging Face model folders, for prompt datasets that users bring.

:func:`load_tokenizer` opens the tokenizer saved in a folder (``tokenizer.json`` and
``tokenizer_config.json``, as ``save_pretrained`` writes them) with transformers'
``AutoTokenizer``, from the local path only: nothing is downloaded. A prompt is
encoded through the tokenizer's chat template when it has one (one user turn and the
generation prompt), else as plain text with the tokenizer's special tokens. The
bundled tasks keep their character tokenizer (:class:`nereus_rl.data.tasks.CharTokenizer`).

transformers is an optional dependency, imported when a tokenizer is loaded.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nereus_rl.data.datasets import OptionalDependencyError

# tokenizer_config.json's class names of a plain tokenizer.json (transformers 4 and 5).
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


class TokenizerError(ValueError):
    """A tokenizer folder cannot be used with the model; the message names the folder."""


def _repo_roots() -> set[Path]:
    """sys.path entries holding a ``kernels/`` package that is not Hugging Face's (a
    source checkout of this project, whose Triton ``kernels/`` folder shadows it)."""
    out = set()
    for p in sys.path:
        root = Path(os.path.abspath(p or "."))
        if (root / "kernels" / "__init__.py").exists() and (root / "nereus_comm").is_dir():
            out.add(root)
    return out


def import_transformers() -> Any:
    """transformers, imported with this project's source root off ``sys.path``.

    transformers 5 imports Hugging Face's ``kernels`` distribution (lazily, e.g. when a
    tokenizer's config is read), and a source checkout's top-level ``kernels/`` folder
    shadows it whenever the checkout's root is on sys.path (``python -m ...`` run from
    it puts it there): the distribution is imported here too, with the root left out,
    so that ``kernels`` names it from then on.

    Raises:
        OptionalDependencyError: transformers is not installed.
    """
    roots = _repo_roots()
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(os.path.abspath(p or ".")) not in roots]
    try:
        try:
            import transformers
        except ImportError:
            raise OptionalDependencyError(
                "a Hugging Face tokenizer needs the package 'transformers', which is not "
                "installed; install it with `pip install transformers`"
            ) from None
        if "kernels" not in sys.modules:
            try:
                import kernels  # noqa: F401
            except ImportError:  # not installed: transformers does without it
                pass
    finally:
        sys.path[:] = saved
    return transformers


class HFTokenizer:
    """A Hugging Face tokenizer as the trainer uses it: prompts to ids, responses to text.

    Arguments:
        tokenizer: a transformers tokenizer.
        path: the folder it came from (for messages).

    Attributes:
        eos_id: the id that ends a response (None: responses run to the length limit).
        pad_id: the id written in left padding and after EOS (never attended to, never
            scored): the tokenizer's pad token, else EOS, else 0.
        chat: the prompts go through the chat template.
    """

    def __init__(self, tokenizer: Any, path: str | Path) -> None:
        self.tokenizer = tokenizer
        self.path = str(path)
        self.eos_id: int | None = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else (self.eos_id or 0)
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce: its base vocabulary and added tokens."""
        return len(self.tokenizer)

    def encode(self, prompt: str) -> list[int]:
        """The ids of one prompt (through the chat template when there is one)."""
        if self.chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            # The template writes the special tokens (BOS) itself.
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """The text of a response's ids, up to its first EOS, special tokens left out."""
        ids = [int(i) for i in ids]
        if self.eos_id is not None and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        """Write the tokenizer's files into ``path`` (beside a saved model)."""
        self.tokenizer.save_pretrained(str(path))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path}, vocab {self.vocab_size})"


def load_tokenizer(path: str | Path, *, vocab: int | None = None) -> HFTokenizer:
    """The tokenizer saved in the folder ``path`` (local files only).

    Arguments:
        path: a folder holding the tokenizer's files (a model folder, usually).
        vocab: the model's vocabulary size: every id the tokenizer produces must be
            below it.

    Raises:
        TokenizerError: no folder, no tokenizer in it, one that transformers cannot load,
            or a vocabulary larger than the model's; the message names the folder.
        OptionalDependencyError: transformers is not installed.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise TokenizerError(f"{folder}: no such folder (the tokenizer is read from it)")
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((folder / n).exists() for n in names):
        raise TokenizerError(
            f"{folder}: no tokenizer there (none of {', '.join(names)}); save one with "
            "tokenizer.save_pretrained(folder), or name another folder"
        )
    transformers = import_transformers()
    declared = None
    if (folder / "tokenizer_config.json").exists():
        try:
            declared = json.loads((folder / "tokenizer_config.json").read_text()).get(
                "tokenizer_class"
            )
        except (OSError, ValueError, AttributeError) as e:
            raise TokenizerError(
                f"{folder / 'tokenizer_config.json'}: not valid JSON ({e})"
            ) from None
    # A tokenizer saved as the generic fast class is its tokenizer.json as it is:
    # AutoTokenizer would take the class of the model's type in config.json instead
    # (transformers 5), which rebuilds another pre-tokenizer around the vocabulary.
    generic = declared in GENERIC_CLASSES and (folder / "tokenizer.json").exists()
    cls = transformers.PreTrainedTokenizerFast if generic else transformers.AutoTokenizer
    try:
        tok = cls.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError and others
        raise TokenizerError(
            f"{folder}: transformers cannot load the tokenizer ({type(e).__name__}: {e})"
        ) from None
    out = HFTokenizer(tok, folder)
    if vocab is not None and out.vocab_size > vocab:
        raise TokenizerError(
            f"{folder}: the tokenizer has {out.vocab_size} tokens but the model's vocabulary "
            f"has {vocab} (vocab_size in config.json); ids past it have no embedding. Use "
            "the model's own tokenizer"
        )
    return out
