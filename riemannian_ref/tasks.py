r"""Generated training tasks: associative recall, modular addition, a character LM.

Every task is produced in-process (no downloads), deterministically from a
seed, as a :class:`TaskData` of fixed examples: inputs ``x``, next-token
targets ``y`` and a boolean ``mask`` of the positions that are scored. A model
is a causal language model ``model(x) -> logits [B, n, V]``; the loss is the
cross-entropy of ``logits`` against ``y`` on the masked positions only.

- :func:`associative_recall`: multi-query associative recall (MQAR) as in the
  Zoology study {cite}`arora2023zoology`: key-value pairs, then queries;
  only the answers are scored, and every answer is determined by the context.
- :func:`modular_addition`: ``a + b mod p`` with a train/validation split of
  the :math:`p^2` pairs by fraction, the grokking setting {cite}`power2022grokking`.
- :func:`char_lm`: characters of real English text that ships with every
  Python >= 3.10: the docstrings of a fixed list of standard-library modules,
  read from their source files with :mod:`ast` (so they exist even under
  ``python -OO``), with a held-out tail.
"""
from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "TaskData",
    "associative_recall",
    "modular_addition",
    "char_lm",
    "stdlib_docstring_text",
    "STDLIB_TEXT_MODULES",
    "make_task",
]


@dataclass
class TaskData:
    """A fixed set of examples for a causal language model.

    ``len(data)`` is the number of examples :math:`N`, ``data.seq_len`` the
    sequence length :math:`n`.

    Parameters
    ----------
    x : Tensor, shape [N, n], int64
        Input token ids.
    y : Tensor, shape [N, n], int64
        Target at every position (the next token; arbitrary where not scored).
    mask : Tensor, shape [N, n], bool
        Positions whose prediction is scored.
    vocab_size : int
        Number of token ids; every id in ``x`` and ``y`` is below it (the
        generators guarantee this; it is not checked here).
    name : str, default ""
        Short description for result files.

    Raises
    ------
    ValueError
        If ``x`` is not a 2-D int64 tensor, ``y`` or ``mask`` has another
        shape than ``x``, or ``mask`` is not bool.
    """

    x: Tensor
    y: Tensor
    mask: Tensor
    vocab_size: int
    name: str = ""

    def __post_init__(self):
        if self.x.dim() != 2 or self.x.dtype != torch.long:
            raise ValueError(f"x must be an int64 tensor of shape [N, n], got {self.x.dtype} {tuple(self.x.shape)}")
        for nm, t in (("y", self.y), ("mask", self.mask)):
            if t.shape != self.x.shape:
                raise ValueError(f"{nm} must have the shape of x {tuple(self.x.shape)}, got {tuple(t.shape)}")
        if self.mask.dtype != torch.bool:
            raise ValueError(f"mask must be bool, got {self.mask.dtype}")

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def seq_len(self) -> int:
        return self.x.shape[1]

    def subset(self, index: Tensor | slice) -> "TaskData":
        """The examples at ``index`` (a slice or an index tensor)."""
        return TaskData(self.x[index], self.y[index], self.mask[index], self.vocab_size, self.name)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def _positive_int(val, name: str, minimum: int = 1) -> int:
    if isinstance(val, bool) or not isinstance(val, int) or val < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {val!r}")
    return val


def associative_recall(n_examples: int, *, vocab_size: int = 64, num_pairs: int = 8,
                       seq_len: int = 32, seed: int = 0) -> TaskData:
    r"""Multi-query associative recall (MQAR) {cite}`arora2023zoology`.

    Each sequence is ``k_1 v_1 k_2 v_2 ... k_N v_N`` followed by queries
    ``q_1 a_1 q_2 a_2 ...`` filling the rest of ``seq_len``: every query is one
    of the context keys (drawn uniformly, with replacement) and its answer is
    the value that followed that key. Keys are drawn without replacement from
    the lower half of the vocabulary, values with replacement from the upper
    half, so the answer to a query is determined by the context and by
    nothing else. Only the answers are scored: ``mask`` is true at the query
    positions, whose target ``y`` is the answer.

    Parameters
    ----------
    n_examples : int
    vocab_size : int
        Even, with ``vocab_size // 2 >= num_pairs`` (distinct keys).
    num_pairs : int
        Number :math:`N` of key-value pairs in the context.
    seq_len : int
        Sequence length :math:`n`, even and at least ``2 * num_pairs + 2``;
        ``(n - 2N) / 2`` queries.
    seed : int

    Returns
    -------
    TaskData with x, y, mask of shape [n_examples, seq_len]
    """
    _positive_int(n_examples, "n_examples")
    _positive_int(num_pairs, "num_pairs")
    _positive_int(vocab_size, "vocab_size", 2)
    _positive_int(seq_len, "seq_len", 2)
    if vocab_size % 2:
        raise ValueError(f"vocab_size must be even (keys and values take one half each), got {vocab_size}")
    half = vocab_size // 2
    if num_pairs > half:
        raise ValueError(f"num_pairs must be <= vocab_size // 2 = {half} (distinct keys), got {num_pairs}")
    if seq_len % 2 or seq_len < 2 * num_pairs + 2:
        raise ValueError(f"seq_len must be even and >= 2 * num_pairs + 2 = {2 * num_pairs + 2}, got {seq_len}")
    g = _gen(seed)
    N, B = num_pairs, n_examples
    n_q = (seq_len - 2 * N) // 2
    keys = torch.rand(B, half, generator=g).argsort(dim=1)[:, :N]  # (B, N) distinct per row
    values = torch.randint(half, vocab_size, (B, N), generator=g)  # (B, N)
    which = torch.randint(0, N, (B, n_q), generator=g)  # (B, n_q) which pair is queried
    queries = keys.gather(1, which)  # (B, n_q)
    answers = values.gather(1, which)  # (B, n_q)
    context = torch.stack([keys, values], dim=2).reshape(B, 2 * N)  # (B, 2N)
    tail = torch.stack([queries, answers], dim=2).reshape(B, 2 * n_q)  # (B, 2 n_q)
    seq = torch.cat([context, tail], dim=1)  # (B, n)
    x = seq
    y = torch.roll(seq, -1, dims=1)  # next token; the last position wraps and is never scored
    mask = torch.zeros(B, seq_len, dtype=torch.bool)
    mask[:, 2 * N::2] = True  # query positions: predict the answer that follows
    return TaskData(x, y, mask, vocab_size, f"recall(V={vocab_size},N={N},n={seq_len})")


def modular_addition(p: int = 97, *, train_fraction: float = 0.5, seed: int = 0
                     ) -> tuple[TaskData, TaskData]:
    r"""All pairs ``(a, b)`` with the target :math:`(a + b) \bmod p` {cite}`power2022grokking`.

    A sequence is ``a b =`` (tokens ``a``, ``b`` in ``[0, p)`` and ``=`` the
    token ``p``); only the last position is scored, with target
    :math:`(a+b) \bmod p` (the targets of the unscored positions are the
    next tokens ``b`` and ``=``). The :math:`p^2` pairs are shuffled with
    ``seed`` and split: the first ``round(train_fraction p^2)`` train, the
    rest validate.

    Parameters
    ----------
    p : int, default 97
        Modulus, at least 2; the operands are ``0, ..., p - 1``.
    train_fraction : float, default 0.5
        Fraction of the :math:`p^2` pairs in the training split, in
        ``(0, 1)``; ``ValueError`` if either split would be empty.
    seed : int, default 0
        Seed of the shuffle that decides the split.

    Returns
    -------
    train, val : TaskData
        ``x``, ``y``, ``mask`` of shape ``[N_train, 3]`` and
        ``[p^2 - N_train, 3]``; ``vocab_size`` is ``p + 1``.
    """
    _positive_int(p, "p", 2)
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must lie in (0, 1), got {train_fraction!r}")
    a, b = torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)  # (p^2,)
    x = torch.stack([a, b, torch.full_like(a, p)], dim=1)  # (p^2, 3)
    y = torch.zeros_like(x)
    y[:, 0], y[:, 1], y[:, 2] = b, p, (a + b) % p
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[:, 2] = True
    perm = torch.randperm(p * p, generator=_gen(seed))
    n_train = int(round(train_fraction * p * p))
    if not 0 < n_train < p * p:
        raise ValueError(f"train_fraction={train_fraction} leaves an empty split for p={p}")
    full = TaskData(x, y, mask, p + 1, f"modadd(p={p})")
    return full.subset(perm[:n_train]), full.subset(perm[n_train:])


#: Standard-library modules whose docstrings make the character-LM corpus.
#: Pure-Python modules present in CPython 3.10 to 3.14 on every platform.
STDLIB_TEXT_MODULES: tuple[str, ...] = (
    "argparse", "collections", "dataclasses", "decimal", "difflib", "email.message",
    "fractions", "functools", "inspect", "logging", "pathlib", "pickle", "random",
    "shutil", "statistics", "string", "subprocess", "tarfile", "textwrap",
    "threading", "typing", "unittest.case", "urllib.parse", "zipfile",
)


def stdlib_docstring_text(modules: tuple[str, ...] = STDLIB_TEXT_MODULES) -> str:
    """The docstrings (module, classes, functions) of stdlib modules.

    Read from the modules' source files with :mod:`ast`, so the text is the
    same under ``-O``/``-OO``; it varies slightly between Python versions.
    Module by module, in the order of ``modules``; within a module in the
    breadth-first order of :func:`ast.walk` (the module's docstring, then its
    top-level classes and functions in source order, then their methods).
    Only docstrings longer than 40 characters are kept. Modules whose source
    is absent (a stripped install) are skipped; if none is found a
    ``RuntimeError`` says so.

    Parameters
    ----------
    modules : tuple of str, default STDLIB_TEXT_MODULES
        Dotted names of pure-Python modules, found with
        :func:`importlib.util.find_spec` (which imports a dotted name's
        parent packages).

    Returns
    -------
    str
        Docstrings separated by blank lines, non-ASCII characters removed.
    """
    parts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    parts.append(doc)
    if not parts:
        raise RuntimeError(f"no standard-library source found for {modules} (Python {sys.version.split()[0]})")
    text = "\n\n".join(parts)
    return text.encode("ascii", "ignore").decode("ascii")


def char_lm(*, block_size: int = 64, val_fraction: float = 0.1, stride: int | None = None,
            text: str | None = None) -> tuple[TaskData, TaskData, dict]:
    r"""Character-level language modelling on :func:`stdlib_docstring_text`.

    The text is encoded with its sorted character set (the alphabet of the
    whole text, so both splits share it); the last
    ``int(len(text) * val_fraction)`` characters are held out. Each split is
    cut into windows of ``block_size + 1`` characters starting every
    ``stride`` characters (an incomplete last window is dropped); ``x`` is a
    window's first ``block_size`` characters, ``y`` the same shifted by one,
    and every position is scored. Deterministic: there is no seed.

    Parameters
    ----------
    block_size : int, default 64
        Sequence length :math:`n` of an example.
    val_fraction : float, default 0.1
        Fraction of the text held out for validation, in ``(0, 1)``. Each
        split needs at least ``block_size + 1`` characters, or
        ``ValueError``.
    stride : int or None, default None
        Offset between the starts of consecutive windows; None:
        ``block_size`` (windows share one character, so the targets of
        consecutive windows do not overlap).
    text : str or None, default None
        The corpus; None: :func:`stdlib_docstring_text`.

    Returns
    -------
    train, val : TaskData
        ``x``, ``y``, ``mask`` of shape ``[N_split, block_size]``;
        ``vocab_size`` is the alphabet size.
    info : dict
        ``chars`` (the alphabet, a str in id order), ``n_chars`` (text
        length), ``source`` (where the text came from).
    """
    _positive_int(block_size, "block_size", 1)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction!r}")
    stride = block_size if stride is None else _positive_int(stride, "stride")
    source = "given text"
    if text is None:
        text = stdlib_docstring_text()
        source = f"docstrings of {len(STDLIB_TEXT_MODULES)} stdlib modules, Python {sys.version.split()[0]}"
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    n_val = int(len(ids) * val_fraction)
    splits = {"train": ids[: len(ids) - n_val], "val": ids[len(ids) - n_val:]}
    out = []
    for split, s in splits.items():
        if len(s) < block_size + 1:
            raise ValueError(f"the {split} split has {len(s)} characters, fewer than block_size + 1 = {block_size + 1}")
        w = s.unfold(0, block_size + 1, stride)  # (N, block_size + 1)
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        out.append(TaskData(x, y, torch.ones_like(x, dtype=torch.bool), len(chars), f"charlm({split})"))
    return out[0], out[1], {"chars": "".join(chars), "n_chars": len(text), "source": source}


def make_task(name: str, seed: int = 0, **kw) -> tuple[TaskData, TaskData]:
    """Train and validation data of a named task: ``"recall"``, ``"modadd"`` or ``"charlm"``.

    ``recall`` takes ``n_train`` (default 4096), ``n_val`` (512) and the
    keywords of :func:`associative_recall` (the validation set uses a
    different seed); ``modadd`` the keywords of :func:`modular_addition`;
    ``charlm`` those of :func:`char_lm`.

    Parameters
    ----------
    name : {"recall", "modadd", "charlm"}
        The task; another name raises ``ValueError``.
    seed : int, default 0
        ``recall``: the training set is drawn with seed ``2 * seed``, the
        validation set with ``2 * seed + 1``. ``modadd``: the seed of the
        split. ``charlm``: ignored (the task is deterministic).
    **kw
        Keyword arguments of the task's generator, as above.

    Returns
    -------
    train, val : TaskData
        ``charlm``'s ``info`` dict is dropped; call :func:`char_lm` for it.
    """
    if name == "recall":
        n_train, n_val = kw.pop("n_train", 4096), kw.pop("n_val", 512)
        train = associative_recall(n_train, seed=2 * seed, **kw)
        val = associative_recall(n_val, seed=2 * seed + 1, **kw)
        return train, val
    if name == "modadd":
        return modular_addition(seed=seed, **kw)
    if name == "charlm":
        train, val, _ = char_lm(**kw)
        return train, val
    raise ValueError(f"task must be one of 'recall', 'modadd', 'charlm', got {name!r}")
