"""Every task generator of riemannian_ref.data: invariants checked by value, determinism, errors."""
import pytest
import torch

import riemannian_ref as rr
from riemannian_ref import data


def g(seed):
    return torch.Generator().manual_seed(seed)


# ---- associative recall (MQAR) ----------------------------------------------

@pytest.mark.parametrize("V,N,n", [(16, 3, 12), (64, 8, 32), (64, 32, 66)])
def test_recall_answers_are_determined_by_context(V, N, n):
    d = rr.associative_recall(200, vocab_size=V, n_pairs=N, seq_len=n, generator=g(3))
    assert d.x.shape == (200, n) and d.x.min() >= 0 and d.x.max() < V
    assert d.vocab_size == V and d.out_dim == V and len(d) == 200 and d.seq_len == n
    keys, values = d.x[:, 0:2 * N:2], d.x[:, 1:2 * N:2]
    assert (keys < V // 2).all() and (values >= V // 2).all()
    # keys are distinct within each sequence, so a key names one value
    assert (keys.sort(dim=1).values.diff(dim=1) > 0).all()
    assert d.mask.sum(dim=1).eq((n - 2 * N) // 2).all()
    assert not d.mask[:, :2 * N].any()
    for b in range(20):
        table = dict(zip(keys[b].tolist(), values[b].tolist()))
        for t in d.mask[b].nonzero().flatten().tolist():
            q, a = d.x[b, t].item(), d.y[b, t].item()
            assert table[q] == a and d.x[b, t + 1].item() == a


def test_recall_deterministic_and_generator_dependent():
    a = rr.associative_recall(50, generator=g(1))
    b = rr.associative_recall(50, generator=g(1))
    c = rr.associative_recall(50, generator=g(2))
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and torch.equal(a.mask, b.mask)
    assert not torch.equal(a.x, c.x)


@pytest.mark.parametrize("kw, match", [
    (dict(vocab_size=15), "vocab_size must be even"),
    (dict(n_pairs=40, vocab_size=64), "n_pairs must be <="),
    (dict(seq_len=16, n_pairs=8), "seq_len must be even and >="),
    (dict(seq_len=33), "seq_len must be even"),
    (dict(generator=0), "generator must be a torch.Generator"),
])
def test_recall_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        rr.associative_recall(4, **kw)


# ---- pair lookup (one head) --------------------------------------------------

def test_pair_lookup_answer_is_the_value_paired_with_the_query():
    K, V, N = 20, 9, 6
    d = rr.pair_lookup(300, n_keys=K, n_values=V, n_pairs=N, generator=g(0))
    assert d.x.shape == (300, N + 1) and d.vocab_size == K * (V + 1) and d.n_classes == V == d.out_dim
    assert d.mask[:, -1].all() and d.mask.sum() == 300  # only the answer is scored
    keys, values = d.x[:, :N] // (V + 1), d.x[:, :N] % (V + 1)
    assert (values < V).all()  # pair tokens carry a real value
    assert all(len(set(row.tolist())) == N for row in keys)  # distinct keys
    qkey, qval = d.x[:, -1] // (V + 1), d.x[:, -1] % (V + 1)
    assert (qval == V).all()  # the query token's value slot is "no value"
    hit = keys == qkey.unsqueeze(1)
    assert (hit.sum(1) == 1).all()  # the query is one of the keys, exactly once
    assert torch.equal(values[hit], d.y[:, -1])
    # every answer class and every position of the queried pair occurs
    assert set(d.y[:, -1].tolist()) == set(range(V)) and set(hit.float().argmax(1).tolist()) == set(range(N))
    assert torch.equal(rr.pair_lookup(300, n_keys=K, n_values=V, n_pairs=N, generator=g(0)).x, d.x)


def test_pair_lookup_errors():
    with pytest.raises(ValueError, match="n_pairs must be <= n_keys"):
        rr.pair_lookup(2, n_keys=5, n_pairs=9)
    with pytest.raises(ValueError, match="n_values must be an int >= 1"):
        rr.pair_lookup(2, n_values=0)


# ---- modular arithmetic -------------------------------------------------------

@pytest.mark.parametrize("op", ["+", "-", "/"])
@pytest.mark.parametrize("p,frac", [(7, 0.3), (13, 0.5), (97, 0.4)])
def test_modular_arithmetic_split_and_targets(p, frac, op):
    tr, va = rr.modular_arithmetic(p, op=op, train_fraction=frac, generator=g(0))
    n_pairs = p * (p - 1) if op == "/" else p * p
    assert len(tr) + len(va) == n_pairs and len(tr) == round(frac * n_pairs)
    pairs = lambda d: {(int(a), int(b)) for a, b in d.x[:, :2].tolist()}  # noqa: E731
    assert not pairs(tr) & pairs(va) and len(pairs(tr) | pairs(va)) == n_pairs  # every pair exactly once
    for d in (tr, va):
        a, b, c = d.x[:, 0], d.x[:, 1], d.y[:, 2]
        if op == "+":
            assert torch.equal(c, (a + b) % p)
        elif op == "-":
            assert torch.equal(c, (a - b) % p)
        else:
            assert (b > 0).all() and torch.equal((c * b) % p, a)  # c = a / b: c b = a (mod p)
        assert d.mask[:, 2].all() and d.mask.sum() == len(d)
        assert (d.x[:, 2] == p).all() and d.vocab_size == p + 1
        assert torch.equal(d.y[:, 0], b) and (d.y[:, 1] == p).all()  # unscored targets: the next tokens


def test_modular_arithmetic_split_depends_on_the_generator_only():
    a, _ = rr.modular_arithmetic(11, generator=g(4))
    b, _ = rr.modular_arithmetic(11, generator=g(4))
    c, _ = rr.modular_arithmetic(11, generator=g(5))
    assert torch.equal(a.x, b.x) and not torch.equal(a.x, c.x)


@pytest.mark.parametrize("kw, match", [
    (dict(p=5, train_fraction=1.0), "train_fraction"),
    (dict(p=5, train_fraction=1), "train_fraction"),
    (dict(p=8, op="/"), "prime"),
    (dict(p=5, op="*"), "op must be"),
    (dict(p=1), "p must be an int >= 2"),
    (dict(p=2, train_fraction=0.01), "empty split"),
])
def test_modular_arithmetic_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        rr.modular_arithmetic(**kw)


# ---- counting -------------------------------------------------------------

def test_counting_targets_by_hand():
    d = rr.counting(6, seq_len=7, vocab_size=3, generator=g(0))
    assert d.x.shape == d.y.shape == (6, 7) and d.mask.all() and d.n_classes == 7 and d.vocab_size == 3
    for b in range(6):
        for i in range(7):
            assert d.y[b, i] == (d.x[b] == d.x[b, i]).sum() - 1
    assert d.y.min() >= 0 and d.y.max() < 7


# ---- character LM ---------------------------------------------------------

def test_char_lm_shift_and_heldout_split():
    text = data.stdlib_docstring_text()
    tr, va, info = rr.char_lm(block_size=32, text=text)
    assert len(text) > 50_000 and len(info["chars"]) == tr.vocab_size == len(set(text))
    assert text.isascii()
    assert torch.equal(tr.x[:, 1:], tr.y[:, :-1])  # y is x shifted by one
    assert tr.mask.all() and len(va) > 0
    decode = lambda ids: "".join(info["chars"][i] for i in ids.tolist())  # noqa: E731
    cut = len(text) - int(0.1 * len(text))
    # training windows lie before the cut, validation windows after it
    assert decode(tr.x[0]) == text[:32] and decode(tr.x[1]) == text[32:64] and decode(tr.y[-1]) in text[:cut]
    assert decode(va.x[0]) == text[cut:cut + 32]
    assert text[cut - 100:cut] not in decode(va.x.flatten())


def test_char_lm_given_text_round_trips():
    text = "the quick brown fox jumps over the lazy dog. " * 4
    tr, va, info = rr.char_lm(block_size=8, val_fraction=0.25, stride=4, text=text)
    decode = lambda ids: "".join(info["chars"][i] for i in ids.tolist())  # noqa: E731
    assert info["source"] == "given text" and info["n_chars"] == len(text)
    cut = len(text) - int(0.25 * len(text))
    for w in range(len(tr)):  # stride 4: window w starts at 4 w
        assert decode(tr.x[w]) == text[4 * w:4 * w + 8] and decode(tr.y[w]) == text[4 * w + 1:4 * w + 9]
    assert decode(va.x[0]) == text[cut:cut + 8]
    with pytest.raises(ValueError, match="val_fraction"):
        rr.char_lm(text=text, val_fraction=1.0)
    with pytest.raises(ValueError, match="fewer than block_size"):
        rr.char_lm(text=text, block_size=100)


def test_char_lm_default_is_the_language_reference_split_by_topic():
    topics = data.python_reference_topics()
    assert len(topics) > 50 and list(topics) == sorted(topics) and all(t.isascii() for t in topics.values())
    tr, va, info = rr.char_lm(block_size=64)
    assert info["source"].startswith("Python language reference") and info["n_chars"] > 400_000
    val_topics = set(info["val_topics"])
    assert val_topics and val_topics < set(topics)
    val_text = "\n\n".join(topics[n] for n in sorted(val_topics))
    train_text = "\n\n".join(t for n, t in topics.items() if n not in val_topics)
    assert info["n_val_chars"] == len(val_text) and info["n_chars"] == len(val_text) + len(train_text)
    # at least val_fraction of the characters, and removing the last held-out topic would go below it
    assert 0.1 <= len(val_text) / info["n_chars"] < 0.1 + max(len(topics[n]) for n in val_topics) / info["n_chars"]
    decode = lambda ids: "".join(info["chars"][i] for i in ids.tolist())  # noqa: E731
    assert decode(tr.x[0]) == train_text[:64] and decode(va.x[0]) == val_text[:64]
    assert decode(va.y[-1]) in val_text and decode(tr.y[-1]) in train_text
    assert len(tr) == (len(train_text) - 1) // 64 and len(va) == (len(val_text) - 1) // 64
    # deterministic: a second call gives the same split
    tr2, va2, info2 = rr.char_lm(block_size=64)
    assert torch.equal(tr.x, tr2.x) and torch.equal(va.x, va2.x) and info2 == info
    docs_tr, _, docs = rr.char_lm(block_size=64, corpus="docstrings")
    assert docs["source"].startswith("docstrings") and "val_topics" not in docs
    with pytest.raises(ValueError, match="corpus"):
        rr.char_lm(corpus="wikipedia")


def test_char_lm_tuning_split_is_disjoint_deterministic_and_leaves_validation_alone():
    topics = data.python_reference_topics()
    tr0, va0, info0 = rr.char_lm(block_size=64)
    tr, va, info = rr.char_lm(block_size=64, tune_fraction=0.1)
    tr_t, tu, info_t = rr.char_lm(block_size=64, tune_fraction=0.1, split="tune")
    val, tune = set(info["val_topics"]), set(info["tune_topics"])
    train = set(topics) - val - tune
    # three disjoint sets of whole topics; the validation topics do not depend on tune_fraction
    assert val and tune and train and not (val & tune)
    assert info["val_topics"] == info0["val_topics"] and torch.equal(va.x, va0.x)
    assert info_t["tune_topics"] == info["tune_topics"] and info_t["split"] == "tune" and info["split"] == "val"
    # the same training text whichever held-out part is asked for, smaller by the tuning topics
    assert torch.equal(tr.x, tr_t.x) and len(tr) < len(tr0)
    assert tr.vocab_size == tu.vocab_size == tr0.vocab_size and info["chars"] == info0["chars"]
    tune_text = "\n\n".join(topics[n] for n in sorted(tune))
    train_text = "\n\n".join(t for n, t in topics.items() if n in train)
    assert info["n_tune_chars"] == len(tune_text) and info0["n_tune_chars"] == 0 and info0["tune_topics"] == []
    assert info["n_chars"] == len(train_text) + len(tune_text) + info["n_val_chars"]
    assert 0.1 <= len(tune_text) / info["n_chars"] < 0.1 + max(len(topics[n]) for n in tune) / info["n_chars"]
    decode = lambda ids: "".join(info["chars"][i] for i in ids.tolist())  # noqa: E731
    assert decode(tu.x[0]) == tune_text[:64] and decode(tr.x[0]) == train_text[:64]
    # each split is exactly its own topics' text, window after window (topics share some boilerplate
    # sentences, so disjointness is by topic, not by string)
    val_text = "\n\n".join(topics[n] for n in sorted(val))
    for d, txt in ((tr, train_text), (tu, tune_text), (va, val_text)):
        assert decode(d.x.flatten()) == txt[:64 * len(d)] and len(d) == (len(txt) - 1) // 64
    # deterministic: a second call gives the same three parts
    tr2, tu2, info2 = rr.char_lm(block_size=64, tune_fraction=0.1, split="tune")
    assert torch.equal(tr2.x, tr_t.x) and torch.equal(tu2.x, tu.x) and info2 == info_t
    # and through make_task, whose seed it ignores
    mtr, mtu = data.make_task("charlm", seed=7, block_size=64, tune_fraction=0.1, split="tune")
    assert torch.equal(mtr.x, tr.x) and torch.equal(mtu.x, tu.x)


def test_char_lm_tuning_split_of_a_given_text_sits_before_the_validation_tail():
    text = "".join(chr(97 + i % 26) for i in range(400))
    tr, tu, info = rr.char_lm(block_size=8, val_fraction=0.25, tune_fraction=0.25, text=text, split="tune")
    _, va, _ = rr.char_lm(block_size=8, val_fraction=0.25, tune_fraction=0.25, text=text)
    decode = lambda ids: "".join(info["chars"][i] for i in ids.tolist())  # noqa: E731
    assert decode(tr.x[0]) == text[:8] and decode(tu.x[0]) == text[200:208] and decode(va.x[0]) == text[300:308]
    assert info["n_tune_chars"] == info["n_val_chars"] == 100 and info["n_chars"] == 400
    assert decode(tr.y[-1]) in text[:200]


@pytest.mark.parametrize("kw, match", [
    (dict(split="test"), "split must be one of"),
    (dict(split="tune"), "split='tune' needs tune_fraction > 0"),
    (dict(tune_fraction=-0.1), "tune_fraction"),
    (dict(tune_fraction=0.95), "tune_fraction"),
    (dict(tune_fraction=True), "tune_fraction"),
    (dict(tune_fraction="0.1"), "tune_fraction"),
])
def test_char_lm_bad_split_arguments_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        rr.char_lm(block_size=8, text="abcdefghij" * 20, **kw)


# ---- make_task ------------------------------------------------------------

def test_make_task_draws_train_and_val_from_the_seed():
    tr, va = data.make_task("recall", seed=3, n_train=20, n_val=10, vocab_size=16, n_pairs=3, seq_len=12)
    assert len(tr) == 20 and len(va) == 10
    assert torch.equal(tr.x, rr.associative_recall(20, vocab_size=16, n_pairs=3, seq_len=12, generator=g(6)).x)
    assert torch.equal(va.x, rr.associative_recall(10, vocab_size=16, n_pairs=3, seq_len=12, generator=g(7)).x)
    lt, _ = data.make_task("lookup", seed=0, n_train=8, n_val=4, n_keys=10, n_values=5, n_pairs=3)
    assert torch.equal(lt.x, rr.pair_lookup(8, n_keys=10, n_values=5, n_pairs=3, generator=g(0)).x)
    ct, _ = data.make_task("counting", seed=1, n_train=8, n_val=4, seq_len=5)
    assert torch.equal(ct.x, rr.counting(8, seq_len=5, generator=g(2)).x)
    mt, mv = data.make_task("modular", seed=2, p=7)
    assert torch.equal(mt.x, rr.modular_arithmetic(7, generator=g(2))[0].x) and len(mt) + len(mv) == 49
    with pytest.raises(ValueError, match="name must be one of"):
        data.make_task("sorting")


def test_task_data_validates_and_subsets():
    x = torch.arange(12).view(3, 4)
    d = rr.TaskData(x, x + 1, x > 5, 13, "t")  # the scored targets reach 12: a vocabulary of 13
    s = d.subset(torch.tensor([2, 0]))
    assert torch.equal(s.x, x[[2, 0]]) and torch.equal(s.y, x[[2, 0]] + 1) and s.vocab_size == 13
    with pytest.raises(ValueError, match="x must be an int64"):
        rr.TaskData(x.float(), x, x > 5, 12)
    with pytest.raises(ValueError, match="mask must have the shape of x"):
        rr.TaskData(x, x, (x > 5)[:2], 12)
    with pytest.raises(ValueError, match="mask must be bool"):
        rr.TaskData(x, x, x, 12)
