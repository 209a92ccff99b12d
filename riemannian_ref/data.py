r"""Every task the book trains on, generated in-process (no downloads).

A task is a :class:`TaskData` of fixed examples: inputs ``x``, targets ``y``
and a boolean ``mask`` of the positions that are scored. A model maps
``x [B, n]`` to logits ``[B, n, C]``; the loss is the cross-entropy of the
logits against ``y`` on the masked positions only (:func:`riemannian_ref.training.train`).
Random tasks draw from a ``torch.Generator`` (CPU) passed as ``generator``;
sizes are keywords with the same names everywhere (``n_examples``,
``vocab_size``, ``n_pairs``, ``seq_len``).

- :func:`associative_recall`: multi-query associative recall (MQAR) as in the
  Zoology study :cite:`arora2023zoology`: key-value pairs, then queries;
  only the answers are scored, and every answer is determined by the context.
- :func:`pair_lookup`: the one-query form read by a single attention head:
  each token is a whole (key, value) pair, the last token a query key.
- :func:`modular_arithmetic`: ``a + b``, ``a - b`` or ``a / b`` modulo a prime,
  with a train/validation split of the pairs by fraction, the grokking setting
  :cite:`power2022grokking`.
- :func:`counting`: for every token, how many tokens of its sequence share its
  symbol (a per-token classification that a collapsed representation cannot solve).
- :func:`char_lm`: characters of real English text that ships with every
  CPython: the Python language reference of :mod:`pydoc_data.topics` (about
  465,000 characters of prose and code; the default, split into training and
  validation by topic, :func:`python_reference_topics`), or the docstrings of a
  fixed list of standard-library modules (:func:`stdlib_docstring_text`).
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import check_int

__all__ = [
    "TaskData",
    "associative_recall",
    "pair_lookup",
    "modular_arithmetic",
    "counting",
    "char_lm",
    "make_task",
    "stdlib_docstring_text",
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
        Number of input token ids; every id in ``x`` is below it.
    name : str, default ""
        Short description for result files.
    n_classes : int or None, default None
        Number of target classes (every scored ``y`` is below it); None: the
        targets are tokens, ``vocab_size``.

    Raises
    ------
    ValueError
        If ``x`` is not a 2-D int64 tensor of ids below ``vocab_size``,
        ``y`` (int64) or ``mask`` (bool) has another shape than ``x``, a
        scored target is outside ``[0, out_dim)``, or ``vocab_size`` /
        ``n_classes`` is not a positive int.
    """

    x: Tensor
    y: Tensor
    mask: Tensor
    vocab_size: int
    name: str = ""
    n_classes: int | None = None

    def __post_init__(self):
        for nm in ("x", "y", "mask"):
            if not isinstance(getattr(self, nm), Tensor):
                raise ValueError(f"{nm} must be a tensor [N, n], got {type(getattr(self, nm)).__name__}")
        if self.x.dim() != 2 or self.x.dtype != torch.long:
            raise ValueError(f"x must be an int64 tensor of shape [N, n], got {self.x.dtype} {tuple(self.x.shape)}")
        for nm, t in (("y", self.y), ("mask", self.mask)):
            if t.shape != self.x.shape:
                raise ValueError(f"{nm} must have the shape of x {tuple(self.x.shape)}, got {tuple(t.shape)}")
        if self.y.dtype != torch.long:
            raise ValueError(f"y must be int64, got {self.y.dtype}")
        if self.mask.dtype != torch.bool:
            raise ValueError(f"mask must be bool, got {self.mask.dtype}")
        check_int(self.vocab_size, "vocab_size")
        if self.n_classes is not None:
            check_int(self.n_classes, "n_classes")
        if self.x.numel() and (int(self.x.min()) < 0 or int(self.x.max()) >= self.vocab_size):
            raise ValueError(f"x must hold token ids in [0, vocab_size) = [0, {self.vocab_size}), got values in "
                             f"[{int(self.x.min())}, {int(self.x.max())}]")
        scored = self.y[self.mask]
        if scored.numel() and (int(scored.min()) < 0 or int(scored.max()) >= self.out_dim):
            raise ValueError(f"y must hold targets in [0, {self.out_dim}) at the scored positions (mask), got "
                             f"values in [{int(scored.min())}, {int(scored.max())}]")

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def seq_len(self) -> int:
        return self.x.shape[1]

    def subset(self, index: Tensor | slice) -> "TaskData":
        """The examples at ``index`` (a slice or an index tensor)."""
        return TaskData(self.x[index], self.y[index], self.mask[index], self.vocab_size, self.name, self.n_classes)

    @property
    def out_dim(self) -> int:
        """Number of target classes (``n_classes`` or ``vocab_size``)."""
        return self.n_classes if self.n_classes is not None else self.vocab_size


def _check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def associative_recall(n_examples: int, *, vocab_size: int = 64, n_pairs: int = 8, seq_len: int = 32,
                       generator: torch.Generator | None = None) -> TaskData:
    r"""Multi-query associative recall (MQAR) :cite:`arora2023zoology`.

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
        Number of sequences.
    vocab_size : int
        Even, with ``vocab_size // 2 >= n_pairs`` (distinct keys).
    n_pairs : int
        Number :math:`N` of key-value pairs in the context.
    seq_len : int
        Sequence length :math:`n`, even and at least ``2 * n_pairs + 2``;
        ``(n - 2N) / 2`` queries.
    generator : torch.Generator, optional
        CPU generator of the draws.

    Returns
    -------
    TaskData with x, y, mask of shape [n_examples, seq_len]
    """
    check_int(n_examples, "n_examples")
    check_int(n_pairs, "n_pairs")
    check_int(vocab_size, "vocab_size", 2)
    check_int(seq_len, "seq_len", 2)
    _check_generator(generator)
    if vocab_size % 2:
        raise ValueError(f"vocab_size must be even (keys and values take one half each), got {vocab_size}")
    half = vocab_size // 2
    if n_pairs > half:
        raise ValueError(f"n_pairs must be <= vocab_size // 2 = {half} (distinct keys), got {n_pairs}")
    if seq_len % 2 or seq_len < 2 * n_pairs + 2:
        raise ValueError(f"seq_len must be even and >= 2 * n_pairs + 2 = {2 * n_pairs + 2}, got {seq_len}")
    g, N, B = generator, n_pairs, n_examples
    n_q = (seq_len - 2 * N) // 2
    keys = torch.rand(B, half, generator=g).argsort(dim=1)[:, :N]  # (B, N) distinct per row
    values = torch.randint(half, vocab_size, (B, N), generator=g)  # (B, N)
    which = torch.randint(0, N, (B, n_q), generator=g)  # (B, n_q) which pair is queried
    queries = keys.gather(1, which)  # (B, n_q)
    answers = values.gather(1, which)  # (B, n_q)
    context = torch.stack([keys, values], dim=2).reshape(B, 2 * N)  # (B, 2N)
    tail = torch.stack([queries, answers], dim=2).reshape(B, 2 * n_q)  # (B, 2 n_q)
    x = torch.cat([context, tail], dim=1)  # (B, n)
    y = torch.roll(x, -1, dims=1)  # next token; the last position wraps and is never scored
    mask = torch.zeros(B, seq_len, dtype=torch.bool)
    mask[:, 2 * N::2] = True  # query positions: predict the answer that follows
    return TaskData(x, y, mask, vocab_size, f"recall(V={vocab_size},N={N},n={seq_len})")


def pair_lookup(n_examples: int, *, n_keys: int = 32, n_values: int = 16, n_pairs: int = 8,
                generator: torch.Generator | None = None) -> TaskData:
    r"""Associative recall in its one-head form: find the pair whose key matches the query.

    Each example holds ``n_pairs`` (key, value) pairs with distinct keys drawn
    from ``n_keys`` symbols and values from ``n_values`` symbols (with
    replacement), then one query key among them; the answer is the value
    paired with it. A pair arrives as ONE token, with id
    ``key * (n_values + 1) + value``; the query token has the id
    ``key * (n_values + 1) + n_values`` (a key with "no value"), so one
    attention head suffices (:class:`riemannian_ref.models.heads.RecallHead`).
    Only the last position is scored; its target is the answer, a class in
    ``[0, n_values)``.

    Parameters
    ----------
    n_examples : int
        Number of examples.
    n_keys : int
        Size of the key vocabulary, ``>= n_pairs``.
    n_values : int
        Size of the value vocabulary, ``>= 1``.
    n_pairs : int
        Pairs per example, ``>= 1``.
    generator : torch.Generator, optional
        CPU generator of the draws.

    Returns
    -------
    TaskData
        ``x``, ``y``, ``mask`` of shape ``[n_examples, n_pairs + 1]``,
        ``vocab_size = n_keys * (n_values + 1)``, ``n_classes = n_values``.
    """
    check_int(n_examples, "n_examples")
    check_int(n_pairs, "n_pairs")
    check_int(n_values, "n_values")
    check_int(n_keys, "n_keys")
    _check_generator(generator)
    if n_pairs > n_keys:
        raise ValueError(f"n_pairs must be <= n_keys = {n_keys} (distinct keys), got {n_pairs}")
    g, B = generator, n_examples
    keys = torch.rand(B, n_keys, generator=g).argsort(-1)[:, :n_pairs]  # (B, N) distinct keys
    values = torch.randint(n_values, (B, n_pairs), generator=g)  # (B, N)
    which = torch.randint(n_pairs, (B,), generator=g)  # (B,)
    rows = torch.arange(B)
    query, answer = keys[rows, which], values[rows, which]  # (B,)
    x = torch.cat([keys * (n_values + 1) + values, (query * (n_values + 1) + n_values).unsqueeze(1)], 1)
    y = torch.zeros_like(x)
    y[:, -1] = answer
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[:, -1] = True
    return TaskData(x, y, mask, n_keys * (n_values + 1), f"lookup(K={n_keys},V={n_values},N={n_pairs})",
                    n_classes=n_values)


def _is_prime(p: int) -> bool:
    return p >= 2 and all(p % f for f in range(2, int(p ** 0.5) + 1))


def modular_arithmetic(p: int = 97, *, op: str = "+", train_fraction: float = 0.5,
                       generator: torch.Generator | None = None) -> tuple[TaskData, TaskData]:
    r"""Binary operations modulo ``p`` on all pairs, split at random :cite:`power2022grokking`.

    A sequence is ``a b =`` (tokens ``a``, ``b`` in ``[0, p)`` and ``=`` the
    token ``p``); only the last position is scored, with target
    :math:`a + b`, :math:`a - b` or :math:`a\,b^{-1}` modulo ``p`` (for
    ``"/"`` the pairs with :math:`b = 0` are left out, and ``p`` must be
    prime). The targets of the unscored positions are the next tokens. The
    pairs are shuffled with ``generator`` and split: the first
    ``round(train_fraction * N)`` train, the rest validate. Addition is
    symmetric in ``a, b`` (order-blind attention can solve it); subtraction
    and division are not.

    Parameters
    ----------
    p : int, default 97
        Modulus, at least 2; the operands are ``0, ..., p - 1``.
    op : {"+", "-", "/"}, default "+"
        The operation.
    train_fraction : float, default 0.5
        Fraction of the pairs in the training split, in ``(0, 1)``;
        ``ValueError`` if either split would be empty.
    generator : torch.Generator, optional
        CPU generator of the shuffle that decides the split.

    Returns
    -------
    train, val : TaskData
        ``x``, ``y``, ``mask`` of shape ``[N_split, 3]``; ``vocab_size`` is ``p + 1``.
    """
    check_int(p, "p", 2)
    _check_generator(generator)
    if op not in ("+", "-", "/"):
        raise ValueError(f"op must be '+', '-' or '/', got {op!r}")
    if op == "/" and not _is_prime(p):
        raise ValueError(f"op='/' needs a prime p (every b != 0 invertible), got p = {p}")
    if isinstance(train_fraction, bool) or not isinstance(train_fraction, float) or not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be a float in (0, 1), got {train_fraction!r}")
    a, b = torch.meshgrid(torch.arange(p), torch.arange(1 if op == "/" else 0, p), indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)  # (N,)
    if op == "+":
        c = (a + b) % p
    elif op == "-":
        c = (a - b) % p
    else:
        c = (a * torch.tensor([pow(int(v), -1, p) for v in b])) % p
    x = torch.stack([a, b, torch.full_like(a, p)], dim=1)  # (N, 3)
    y = torch.stack([b, torch.full_like(a, p), c], dim=1)
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[:, 2] = True
    N = len(a)
    perm = torch.randperm(N, generator=generator)
    n_train = int(round(train_fraction * N))
    if not 0 < n_train < N:
        raise ValueError(f"train_fraction={train_fraction} leaves an empty split for p={p}")
    full = TaskData(x, y, mask, p + 1, f"modular(a{op}b, p={p})")
    return full.subset(perm[:n_train]), full.subset(perm[n_train:])


def counting(n_examples: int, *, seq_len: int = 16, vocab_size: int = 8,
             generator: torch.Generator | None = None) -> TaskData:
    """Counting: for every token, how many tokens of its sequence share its symbol.

    Every position keeps its own answer, so a collapsed, identical-row
    representation cannot solve it, and attention must compare tokens. Every
    position is scored; the target is the count minus one, a class in
    ``[0, seq_len)``.

    Parameters
    ----------
    n_examples : int
        How many sequences to draw.
    seq_len : int
        Sequence length, which is also the number of classes.
    vocab_size : int
        Number of symbols, drawn uniformly and independently per position.
    generator : torch.Generator, optional
        CPU generator of the draws.

    Returns
    -------
    TaskData
        ``x``, ``y``, ``mask`` of shape ``[n_examples, seq_len]``, ``n_classes = seq_len``.
    """
    check_int(n_examples, "n_examples")
    check_int(seq_len, "seq_len")
    check_int(vocab_size, "vocab_size")
    _check_generator(generator)
    x = torch.randint(vocab_size, (n_examples, seq_len), generator=generator)  # (N, n)
    y = (x.unsqueeze(-1) == x.unsqueeze(-2)).sum(-1) - 1  # (N, n)
    return TaskData(x, y, torch.ones_like(x, dtype=torch.bool), vocab_size,
                    f"counting(V={vocab_size},n={seq_len})", n_classes=seq_len)


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


#: The accepted values of ``char_lm(corpus=...)``.
CORPORA = ("reference", "docstrings")


def python_reference_topics() -> dict[str, str]:
    """The Python language reference that ships with CPython, topic by topic.

    :mod:`pydoc_data.topics` holds the text ``help()`` shows for keywords and
    language topics ("assert", "assignment", "class", ...): the language
    reference and parts of the library reference as plain text, about 80
    topics and 465,000 characters in CPython 3.11 (the text changes slightly
    between versions). Non-ASCII characters (a few hundred) are removed.

    Returns
    -------
    dict of str to str
        Topic name to its text, in sorted order of the names.

    Raises
    ------
    RuntimeError
        If this Python has no :mod:`pydoc_data` (a stripped installation).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # pragma: no cover - every CPython ships it
        raise RuntimeError(f"pydoc_data.topics is missing from this Python ({sys.version.split()[0]})") from e
    return {name: topics[name].encode("ascii", "ignore").decode("ascii") for name in sorted(topics)}


#: The accepted values of ``char_lm(split=...)``: which held-out text comes back second.
CHAR_LM_SPLITS = ("val", "tune")


def char_lm(*, block_size: int = 64, val_fraction: float = 0.1, stride: int | None = None,
            text: str | None = None, corpus: str = "reference", tune_fraction: float = 0.0,
            split: str = "val") -> tuple[TaskData, TaskData, dict]:
    r"""Character-level language modelling on real text that ships with Python.

    ``corpus="reference"`` (default): the Python language reference,
    :func:`python_reference_topics`, split **by topic** so that no topic is
    in both splits: the topics, ordered by the SHA-256 of their names (a
    fixed, name-determined shuffle), go to validation one by one until it
    holds at least ``val_fraction`` of the characters; the rest train. Each
    split is its topics in name order, separated by blank lines.
    ``corpus="docstrings"`` or a given ``text``: the last
    ``int(len(text) * val_fraction)`` characters are held out
    (:func:`stdlib_docstring_text` is the docstrings corpus).

    **Tuning split.** With ``tune_fraction > 0`` a third part is held out
    for choosing hyperparameters, so that evaluation never sees the text a
    rate was selected on: for the reference, the topics that follow the
    validation topics in the same hash order, until it holds at least
    ``tune_fraction`` of the characters; for a tail split, the
    ``int(len(text) * tune_fraction)`` characters before the validation
    tail. Training loses that text whichever ``split`` is asked for, so
    tuning and evaluation runs train on the same characters, and the
    validation topics do not depend on ``tune_fraction`` (with the default
    0 the splits are those of earlier releases). ``split`` picks the
    held-out part returned second: ``"val"`` (evaluation) or ``"tune"``.

    The text is encoded with its sorted character set (the alphabet of both
    splits together). Each split is cut into windows of ``block_size + 1``
    characters starting every ``stride`` characters (an incomplete last
    window is dropped); ``x`` is a window's first ``block_size`` characters,
    ``y`` the same shifted by one, and every position is scored.
    Deterministic: there is no seed.

    Parameters
    ----------
    block_size : int, default 64
        Sequence length :math:`n` of an example.
    val_fraction : float, default 0.1
        Fraction of the characters held out for validation, in ``(0, 1)``.
        Each split needs at least ``block_size + 1`` characters, or
        ``ValueError``.
    stride : int or None, default None
        Offset between the starts of consecutive windows; None:
        ``block_size`` (windows share one character, so the targets of
        consecutive windows do not overlap).
    text : str or None, default None
        A corpus of your own (split by its tail); None: ``corpus``.
    corpus : {"reference", "docstrings"}, default "reference"
        Which text that ships with Python (ignored when ``text`` is given).
    tune_fraction : float, default 0.0
        Fraction of the characters held out for tuning, in ``[0, 1)``, with
        ``val_fraction + tune_fraction < 1``; 0: no tuning split.
    split : {"val", "tune"}, default "val"
        The held-out part returned second; ``"tune"`` needs
        ``tune_fraction > 0``.

    Returns
    -------
    train, held_out : TaskData
        ``x``, ``y``, ``mask`` of shape ``[N_split, block_size]``;
        ``vocab_size`` is the alphabet size (of the whole text, every
        split together); ``held_out`` is the part ``split`` names.
    info : dict
        ``chars`` (the alphabet, a str in id order), ``n_chars`` (text
        length, every split), ``n_val_chars``, ``n_tune_chars``, ``split``,
        ``source`` (where the text came from) and, for the reference,
        ``val_topics`` and ``tune_topics`` (names of the held-out topics).

    Raises
    ------
    ValueError
        If ``split`` is not ``"val"`` or ``"tune"``, ``split="tune"`` comes
        without ``tune_fraction > 0``, a fraction is out of range, or a split
        is shorter than ``block_size + 1`` characters.
    """
    check_int(block_size, "block_size", 1)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction!r}")
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}, got {corpus!r}")
    if (isinstance(tune_fraction, bool) or not isinstance(tune_fraction, (int, float))
            or not 0.0 <= tune_fraction < 1.0 or val_fraction + tune_fraction >= 1.0):
        raise ValueError(f"tune_fraction must lie in [0, 1) with val_fraction + tune_fraction < 1, got "
                         f"{tune_fraction!r} (val_fraction {val_fraction!r})")
    if split not in CHAR_LM_SPLITS:
        raise ValueError(f"split must be one of {CHAR_LM_SPLITS}, got {split!r}")
    if split == "tune" and tune_fraction == 0:
        raise ValueError("split='tune' needs tune_fraction > 0 (there is no tuning text without it)")
    stride = block_size if stride is None else check_int(stride, "stride")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"text must be a str or None, got {type(text).__name__}")
    info: dict = {}
    if text is None and corpus == "reference":
        topics = python_reference_topics()
        total = sum(len(t) for t in topics.values())
        val_topics, tune_topics, n_val, n_tune = [], [], 0, 0
        for name in sorted(topics, key=lambda t: hashlib.sha256(t.encode()).hexdigest()):
            if n_val < val_fraction * total:
                val_topics.append(name)
                n_val += len(topics[name])
            elif n_tune < tune_fraction * total:
                tune_topics.append(name)
                n_tune += len(topics[name])
            else:
                break
        held = set(val_topics) | set(tune_topics)
        parts = {"train": "\n\n".join(t for name, t in topics.items() if name not in held),
                 "val": "\n\n".join(t for name, t in topics.items() if name in val_topics),
                 "tune": "\n\n".join(t for name, t in topics.items() if name in tune_topics)}
        info["val_topics"] = sorted(val_topics)
        info["tune_topics"] = sorted(tune_topics)
        info["source"] = (f"Python language reference (pydoc_data.topics, {len(topics)} topics), "
                          f"Python {sys.version.split()[0]}")
    else:
        source = "given text"
        if text is None:
            text = stdlib_docstring_text()
            source = f"docstrings of {len(STDLIB_TEXT_MODULES)} stdlib modules, Python {sys.version.split()[0]}"
        n_val, n_tune = int(len(text) * val_fraction), int(len(text) * tune_fraction)
        cut = len(text) - n_val
        parts = {"train": text[: cut - n_tune], "val": text[cut:], "tune": text[cut - n_tune: cut]}
        info["source"] = source
    if tune_fraction == 0:
        del parts["tune"]
    chars = sorted(set().union(*parts.values()))
    lookup = {c: i for i, c in enumerate(chars)}
    out = {}
    for name in ("train", split):
        s = torch.tensor([lookup[c] for c in parts[name]], dtype=torch.long)
        if len(s) < block_size + 1:
            raise ValueError(f"the {name} split has {len(s)} characters, fewer than block_size + 1 = {block_size + 1}")
        w = s.unfold(0, block_size + 1, stride)  # (N, block_size + 1)
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        out[name] = TaskData(x, y, torch.ones_like(x, dtype=torch.bool), len(chars), f"charlm({name})")
    info.update(chars="".join(chars), n_chars=sum(len(t) for t in parts.values()), n_val_chars=len(parts["val"]),
                n_tune_chars=len(parts.get("tune", "")), split=split)
    return out["train"], out[split], info


def make_task(name: str, *, seed: int = 0, **kw) -> tuple[TaskData, TaskData]:
    """Train and validation data of a named task, drawn from one seed.

    Parameters
    ----------
    name : {"recall", "lookup", "modular", "counting", "charlm"}
        :func:`associative_recall`, :func:`pair_lookup`, :func:`modular_arithmetic`,
        :func:`counting` or :func:`char_lm`; another name raises ``ValueError``.
    seed : int, default 0
        Seeds the generator of the task's draws: for the sampled tasks the
        training set is drawn with seed ``2 * seed`` and the validation set
        with ``2 * seed + 1``; for ``modular`` it is the seed of the split;
        ``charlm`` is deterministic and ignores it.
    **kw
        Keywords of the task's generator; the sampled tasks also take
        ``n_train`` (default 4096) and ``n_val`` (default 512).

    Returns
    -------
    train, val : TaskData
        ``charlm``'s ``info`` dict is dropped; call :func:`char_lm` for it.
    """
    sampled = {"recall": associative_recall, "lookup": pair_lookup, "counting": counting}
    if name in sampled:
        n_train, n_val = kw.pop("n_train", 4096), kw.pop("n_val", 512)
        make = sampled[name]
        return (make(n_train, generator=torch.Generator().manual_seed(2 * seed), **kw),
                make(n_val, generator=torch.Generator().manual_seed(2 * seed + 1), **kw))
    if name == "modular":
        return modular_arithmetic(generator=torch.Generator().manual_seed(seed), **kw)
    if name == "charlm":
        train, val, _ = char_lm(**kw)
        return train, val
    raise ValueError(f"name must be one of 'recall', 'lookup', 'modular', 'counting', 'charlm', got {name!r}")
