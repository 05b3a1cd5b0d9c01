"""Extreme multi-label classification with one giant bias-free linear layer (DRAGONN's XML
workload: Wiki10-31K, 4096 → 30938, 126.72M parameters in a single tensor).

DRAGONN embeds the sparse bag-of-words input into 4096 dimensions "following Chen et al.
(2020)" and trains only the last layer. Here the embedding is a fixed signed feature
hashing (count sketch: feature f adds sign(f)·value to coordinate bucket(f), both drawn
once from a fixed seed), L2-normalised per point, computed per batch from the sparse
input; it has no trainable parameters, so the model is exactly the one 4096 × labels
tensor the paper describes. Loss: softmax cross-entropy against the point's label set
normalised to sum to one (the usual XML softmax objective); metric P@1.

Stand-in (no extreme-classification set ships offline): MovieLens-100K as a multi-label
"next movies" problem. Each user's ratings in time order are cut into windows; a point's
features are the 20 movies of a window, its labels the next 10 movies the user rated
(1682 features, 1682 labels, about 7,000 points); a fifth of the users (user id % 5 == 0)
are held out for evaluation.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks import data as D
from tasks.base import Task, model_device, register_task
from tasks.hyperparams import HParam, count


def movielens_next_items(
    ratings: np.ndarray, history: int = 20, future: int = 10, stride: int = 10
):
    """(train, test) SparseXML built from MovieLens ratings as described in the module doc."""
    users_raw, items_raw, ts = ratings[:, 0], ratings[:, 1], ratings[:, 2]
    _, items = np.unique(items_raw, return_inverse=True)
    n_items = int(items.max()) + 1
    order = np.lexsort((np.arange(len(ts)), ts, users_raw))
    users_raw, items = users_raw[order], items[order]
    bounds = np.flatnonzero(np.r_[True, users_raw[1:] != users_raw[:-1], True])
    parts = {"train": ([0], [], [0], []), "test": ([0], [], [0], [])}
    for a, b in zip(bounds[:-1], bounds[1:]):
        seq = items[a:b]
        split = "test" if users_raw[a] % 5 == 0 else "train"
        fptr, fidx, lptr, lidx = parts[split]
        for s in range(0, len(seq) - history - future + 1, stride):
            fidx.extend(seq[s : s + history].tolist())
            lidx.extend(seq[s + history : s + history + future].tolist())
            fptr.append(len(fidx))
            lptr.append(len(lidx))
    return tuple(
        D.SparseXML(n_items, n_items, fptr, fidx, np.ones(len(fidx), np.float32), lptr, lidx)
        for fptr, fidx, lptr, lidx in (parts["train"], parts["test"])
    )


class FeatureHasher:
    """Signed feature hashing of CSR rows into `dim` dense coordinates."""

    def __init__(self, num_features: int, dim: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.dim = dim
        self.bucket = torch.randint(0, dim, (num_features,), generator=gen)
        self.sign = torch.randint(0, 2, (num_features,), generator=gen).float() * 2 - 1

    def __call__(self, xml: D.SparseXML, rows: torch.Tensor) -> torch.Tensor:
        pos, row_of = _csr_positions(xml.feat_ptr, rows)
        f = xml.feat_idx[pos]
        out = torch.zeros(len(rows), self.dim)
        out.index_put_((row_of, self.bucket[f]), self.sign[f] * xml.feat_val[pos], accumulate=True)
        return F.normalize(out, dim=1)


def _csr_positions(ptr: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of the entries of CSR `rows`, and the batch row each belongs to."""
    start, lens = ptr[rows], ptr[rows + 1] - ptr[rows]
    row_of = torch.repeat_interleave(torch.arange(len(rows)), lens)
    offsets = torch.cumsum(lens, 0) - lens
    pos = start[row_of] + torch.arange(int(lens.sum())) - offsets[row_of]
    return pos, row_of


def label_matrix(xml: D.SparseXML, rows: torch.Tensor) -> torch.Tensor:
    pos, row_of = _csr_positions(xml.label_ptr, rows)
    y = torch.zeros(len(rows), xml.num_labels)
    y[row_of, xml.label_idx[pos]] = 1.0
    return y


@register_task("wiki10_xml")
class Wiki10XML(Task):
    """One bias-free 4096 × 30938 linear layer on Wiki10-31K, P@1 (DRAGONN's XML).

    DRAGONN Section 5.1: Wiki10-31K (14,146 train / 6,616 test points), inputs
    embedded to 4096, one bias-free Linear(4096, 30938) (126.72M parameters), metric P@1.
    Hyper-parameters: conf/task/wiki10_xml.yaml."""

    metric = "p@1"
    paper = "DRAGONN (Wang et al., 2022), Section 5.1: XML / Wiki10-31K"
    # the width the sparse inputs are hashed to: the layer's input features
    extra_hparams: ClassVar[dict[str, HParam]] = {"embed_dim": count(required=True)}
    paper_param_count = 126_722_048  # 4096 × 30938: DRAGONN's "126.72M"

    def __init__(self, **common: Any):
        super().__init__(**common)
        if self.data == "canonical":
            self._paths = (
                D.find_xml_split(self.data_root, "train"),
                D.find_xml_split(self.data_root, "test"),
            )
            self.data_source = f"Wiki10-31K ({self._paths[0].name}, {self._paths[1].name})"
        else:
            self._paths = None
            D.recbole_ml100k()
            self.data_source = (
                "MovieLens-100K as multi-label next-movies (20 movies in, next 10 as labels; "
                "stand-in for Wiki10-31K)"
            )
        self.data_source += f", hashed to {self.hparams['embed_dim']} inputs"

    def splits(self) -> tuple[D.SparseXML, D.SparseXML]:
        if self._paths:
            return D.read_xml_sparse(self._paths[0]), D.read_xml_sparse(self._paths[1])
        return D.memo(("ml100k-next-items",), lambda: movielens_next_items(D.recbole_ml100k()))

    def hasher(self) -> FeatureHasher:
        nf = self.splits()[0].num_features
        return D.memo(
            ("hasher", nf, self.hparams["embed_dim"]),
            lambda: FeatureHasher(nf, self.hparams["embed_dim"]),
        )

    def paper_target(self):
        return 0.80  # DRAGONN Table 2: speed-ups "when reaching ... 80% accuracy in Wiki10-31K"

    def build_model(self):
        return nn.Linear(self.hparams["embed_dim"], self.splits()[0].num_labels, bias=False)

    def num_train(self):
        return len(self.splits()[0])

    def make_batch(self, indices, generator):
        train = self.splits()[0]
        return self.hasher()(train, indices), label_matrix(train, indices)

    def loss(self, model, batch):
        x, y = batch
        dev = model_device(model)
        y = y.to(dev)
        target = y / y.sum(dim=1, keepdim=True).clamp_min(1.0)  # points without labels add nothing
        return -(target * F.log_softmax(model(x.to(dev)).float(), dim=1)).sum(dim=1).mean()

    def _evaluate(self, model, max_batches):
        test = self.splits()[1]
        dev = model_device(model)
        bs = self.hparams["eval_batch_size"]
        hits = n = 0
        for b, i in enumerate(range(0, len(test), bs)):
            if max_batches is not None and b >= max_batches:
                break
            rows = torch.arange(i, min(i + bs, len(test)))
            top = model(self.hasher()(test, rows).to(dev)).argmax(dim=1).cpu()
            hits += int(label_matrix(test, rows)[torch.arange(len(rows)), top].sum())
            n += len(rows)
        return {"p@1": hits / max(n, 1)}
