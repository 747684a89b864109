"""The benchmark's classical peer (character n-gram TF-IDF + logistic regression) on toy sets built here."""

from __future__ import annotations

import random

A, B = "天地人山水火木金土日", "鹦鹉螺龟蛇"


def _recall(pred, y, c):
    hits = [p == c for p, t in zip(pred, y) if t == c]
    return sum(hits) / len(hits)


def test_peer_separates_a_planted_character_trigram():
    """Class 1 holds 鹦鹉螺 in that order, class 0 the same three characters in other orders: only an
    n-gram (not a bag of characters) tells them apart."""
    from benchmarks.ncal_bench import tfidf_predict

    def make(seed, n):
        rng = random.Random(seed)
        X, y = [], []
        for c in (0, 1):
            for _ in range(n):
                t = "".join(rng.choice(A) for _ in range(rng.randint(6, 14)))
                k = rng.randint(0, len(t))
                t = t[:k] + ("鹦鹉螺" if c == 1 else rng.choice(["螺鹉鹦", "鹉鹦螺", "鹦螺鹉"])) + t[k:]
                X.append(t); y.append(c)
        return X, y

    Xtr, ytr = make(0, 60)
    Xte, yte = make(1, 40)
    for balanced in (False, True):
        pred = tfidf_predict(Xtr, ytr, Xte, balanced=balanced)
        assert sum(p == t for p, t in zip(pred, yte)) / len(yte) > 0.95


def test_balanced_weighting_raises_minority_recall():
    """300 majority texts from alphabet A, 10 minority texts with a fifth of their characters from B; on such
    test texts the unweighted model mostly answers the majority, the class-weighted one much less so."""
    from benchmarks.ncal_bench import tfidf_predict

    def make(seed, n_maj, n_min):
        rng = random.Random(seed)

        def text(frac_b):
            return "".join(rng.choice(B) if rng.random() < frac_b else rng.choice(A) for _ in range(rng.randint(6, 12)))

        return [text(0.0) for _ in range(n_maj)] + [text(0.2) for _ in range(n_min)], [0] * n_maj + [1] * n_min

    Xtr, ytr = make(0, 300, 10)
    Xte, yte = make(100, 200, 50)
    plain = tfidf_predict(Xtr, ytr, Xte, balanced=False)
    weighted = tfidf_predict(Xtr, ytr, Xte, balanced=True)
    assert _recall(weighted, yte, 1) >= _recall(plain, yte, 1) + 0.2
    assert _recall(weighted, yte, 0) > 0.9 and _recall(plain, yte, 0) > 0.9
