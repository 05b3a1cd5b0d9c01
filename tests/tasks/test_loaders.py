"""The canonical loaders on small files written here in the real formats (CIFAR pickles,
an ImageFolder tree, PTB/WikiText text, MovieLens ratings, extreme-classification sparse
files, GLUE SST-2 TSV, SQuAD JSON), and the offline stand-ins' construction."""

from __future__ import annotations

import gzip
import json
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import tasks
from tasks import data as D

# -- images ----------------------------------------------------------------------------------------


def test_read_idx_plain_and_gzipped(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    raw = bytes([0, 0, 8, 3]) + np.array([2, 3, 4], dtype=">u4").tobytes() + arr.tobytes()
    (tmp_path / "x-idx3-ubyte").write_bytes(raw)
    with gzip.open(tmp_path / "x-idx3-ubyte.gz", "wb") as f:
        f.write(raw)
    for name in ("x-idx3-ubyte", "x-idx3-ubyte.gz"):
        assert np.array_equal(D.read_idx(tmp_path / name), arr)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01" + raw[4:])
    with pytest.raises(ValueError, match="not an unsigned-byte idx"):
        D.read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(raw[:-3])
    with pytest.raises(ValueError, match="header says"):
        D.read_idx(tmp_path / "short")


def test_fashion_mnist_standin():
    a = D.load_fashion_mnist()
    assert a["train_x"].shape == (60000, 28, 28) and a["test_x"].shape == (10000, 28, 28)
    assert a["train_x"].dtype == torch.uint8
    for y in (a["train_y"], a["test_y"]):
        assert int(y.min()) == 0 and int(y.max()) == 9
    task = tasks.build_task("cifar10_resnet20")
    x, y = task.fixed_batch()
    assert x.shape == (32, 3, 32, 32) and y.shape == (32,)
    assert torch.equal(x[:, 0], x[:, 1])  # grey repeated to 3 channels
    # Zero padding: the 2-pixel border holds the normalised value of black.
    assert torch.allclose(x[:, :, :2, :], torch.full_like(x[:, :, :2, :], -0.2860 / 0.3530))
    assert abs(float(x.mean())) < 0.5 and 0.5 < float(x.std()) < 1.5


def test_random_crop_flip_is_a_shifted_or_mirrored_crop():
    from tasks.vision import random_crop_flip

    x = torch.rand(6, 2, 5, 5)
    out = random_crop_flip(x, 2, torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(6):
        crops = [padded[i, :, dy : dy + 5, dx : dx + 5] for dy in range(5) for dx in range(5)]
        assert any(torch.equal(out[i], c) or torch.equal(out[i], c.flip(2)) for c in crops)


def _write_cifar(root: Path, n_per_file: int, num_classes: int) -> dict:
    rng = np.random.default_rng(0)
    if num_classes == 10:
        folder, files, key = (
            root / "cifar-10-batches-py",
            [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"],
            b"labels",
        )
    else:
        folder, files, key = root / "cifar-100-python", ["train", "test"], b"fine_labels"
    folder.mkdir(parents=True)
    written = {}
    for f in files:
        data = rng.integers(0, 256, (n_per_file, 3072), dtype=np.uint8)
        labels = list(rng.integers(0, num_classes, n_per_file))
        labels[0] = num_classes - 1
        with open(folder / f, "wb") as fh:
            pickle.dump({key: labels, b"data": data, b"batch_label": f.encode()}, fh)
        written[f] = (data, labels)
    return written


def test_cifar10_pickles(tmp_path):
    written = _write_cifar(tmp_path, 8, 10)
    task = tasks.build_task(
        "cifar10_resnet20", data="canonical", data_root=str(tmp_path), batch_size=4
    )
    a = task.arrays()
    assert a["train_x"].shape == (40, 3, 32, 32) and a["test_x"].shape == (8, 3, 32, 32)
    assert np.array_equal(a["train_x"][8:16].numpy().reshape(8, -1), written["data_batch_2"][0])
    assert a["train_y"].tolist()[:8] == [int(v) for v in written["data_batch_1"][1]]
    assert task.num_train() == 40 and task.steps_per_epoch(2) == 5
    x, y = task.make_batch(torch.tensor([0, 9]), None)
    from tasks.vision import CIFAR10_MEAN, CIFAR10_STD

    raw = a["train_x"][[0, 9]].float() / 255
    expected = (raw - torch.tensor(CIFAR10_MEAN)[:, None, None]) / torch.tensor(CIFAR10_STD)[
        :, None, None
    ]
    assert torch.allclose(x, expected) and y.tolist() == a["train_y"][[0, 9]].tolist()
    assert "CIFAR-10" in task.data_source and "stand-in" not in task.data_source
    torch.manual_seed(0)
    ev = task.evaluate(task.build_model())
    assert 0.0 <= ev["accuracy"] <= ev["top5"] <= 1.0


def test_cifar100_pickles_and_label_range(tmp_path):
    _write_cifar(tmp_path, 6, 100)
    task = tasks.build_task(
        "cifar100_resnet50",
        data="canonical",
        data_root=str(tmp_path / "cifar-100-python"),
        batch_size=2,
    )
    a = task.arrays()
    assert a["train_x"].shape == (6, 3, 32, 32) and int(a["train_y"].max()) == 99
    assert task.num_classes == 100
    assert task.build_model()(task.fixed_batch()[0]).shape == (2, 100)


def test_cifar_bad_file_is_refused(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / f, "wb") as fh:
            pickle.dump({b"labels": [0], b"data": np.zeros((1, 100), np.uint8)}, fh)
    with pytest.raises(ValueError, match="3072"):
        D.load_cifar(tmp_path, 10)


def test_imagefolder_tree(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 4), ("val", 2)):
        for cls in ("n01", "n02", "n03"):
            d = tmp_path / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(
                    d / f"{i}.png"
                )
    task = tasks.build_task(
        "imagenet_resnet50",
        data="canonical",
        data_root=str(tmp_path),
        batch_size=3,
        loader_workers=0,
    )
    assert task.num_train() == 12 and task.num_classes == 1000
    batches = list(task.train_batches(0, 2, 0))
    assert len(batches) == 2
    for x, y in batches:
        assert x.shape == (3, 3, 32, 32) and set(y.tolist()) <= {0, 1, 2}
    x, y = task.fixed_batch(1, 2)
    assert x.shape == (3, 3, 32, 32)
    torch.manual_seed(0)
    ev = task.evaluate(task.build_model())
    assert 0.0 <= ev["accuracy"] <= ev["top5"] <= 1.0


# -- word-level text -------------------------------------------------------------------------------
PTB_LINES = {
    "train": [" the cat sat on the mat ", " a dog <unk> N years "] * 30,
    "valid": [" the dog sat "],
    "test": [" a cat on a mat ", " the <unk> sat N "] * 5,
}


def test_ptb_text_files(tmp_path):
    for split, lines in PTB_LINES.items():
        (tmp_path / f"ptb.{split}.txt").write_text("\n".join(lines) + "\n")
    corpus = D.load_word_corpus(tmp_path, "ptb")
    assert corpus.itos[:6] == ["the", "cat", "sat", "on", "mat", "<eos>"]
    words = [corpus.itos[i] for i in corpus.ids["train"][:13]]
    assert words == "the cat sat on the mat <eos> a dog <unk> N years <eos>".split()
    assert len(corpus.ids["test"]) == 5 * (6 + 5)
    task = tasks.build_task("ptb_lstm", data="canonical", data_root=str(tmp_path), batch_size=3)
    assert task.data_source.startswith("Penn Treebank (")
    x, y = task.fixed_batch()
    assert x.shape == y.shape == (task.hparams["bptt"], 3)
    assert torch.equal(x[1:], y[:-1])  # targets are the inputs shifted by one token
    stream = corpus.ids["train"].tolist()
    col = x[:, 0].tolist() + [int(y[-1, 0])]
    assert any(stream[i : i + len(col)] == col for i in range(len(stream)))  # a real window
    torch.manual_seed(0)
    ev = task.evaluate(task.build_model())
    assert ev["perplexity"] >= 1.0 and ev["perplexity"] == pytest.approx(
        np.exp(ev["loss"]), rel=1e-5
    )
    paper = tasks.build_task("ptb_lstm", size="paper", data="canonical", data_root=str(tmp_path))
    assert paper.vocab_size == 10_000  # padded to PTB's vocabulary


def test_wikitext2_files_in_subfolder(tmp_path):
    sub = tmp_path / "wikitext-2"
    sub.mkdir()
    for split in ("train", "valid", "test"):
        (sub / f"wiki.{split}.tokens").write_text(
            " = Title = \n\n The game @-@ play , in 1999 . \n"
        )
    corpus = D.load_word_corpus(tmp_path, "wikitext2")
    words = [corpus.itos[i] for i in corpus.ids["train"]]
    assert words == [
        "=",
        "Title",
        "=",
        "<eos>",
        "<eos>",
        "The",
        "game",
        "@-@",
        "play",
        ",",
        "in",
        "1999",
        ".",
        "<eos>",
    ]
    task = tasks.build_task(
        "wikitext2_lstm", size="paper", data="canonical", data_root=str(tmp_path)
    )
    assert task.vocab_size == 33_278


@pytest.mark.slow
def test_shakespeare_lm_standins():
    ptb = D.shakespeare_corpus("ptb")
    assert len(ptb) == 10_000 and "<unk>" in ptb.stoi and "<eos>" in ptb.stoi
    assert all(w == w.lower() or w in ("N",) for w in ptb.itos if w not in ("<unk>", "<eos>"))
    assert 600_000 < len(ptb.ids["train"]) < 1_000_000  # PTB-sized (PTB train: 930k words)
    wt = D.shakespeare_corpus("wikitext")
    assert "," in wt.stoi and "Hamlet" in wt.stoi
    split = D.split_by_work(list(D.shakespeare_works()))
    assert not set(split["train"]) & (set(split["valid"]) | set(split["test"]))
    assert len(split["test"]) >= 4


def test_shared_ptb_splits_are_used_when_present():
    shared = D.shared_ptb_dir()
    task = tasks.build_task("ptb_lstm")
    if shared is None:  # CI and this checkout have ../shared; elsewhere the Shakespeare fallback
        assert "Shakespeare" in task.data_source
        return
    assert "trained on ptb.valid.txt, evaluated on ptb.test.txt" in task.data_source
    corpus = task.corpus()
    with open(shared / "ptb.valid.txt") as f:
        assert len(corpus.ids["train"]) == sum(len(line.split()) + 1 for line in f)


# -- ratings ---------------------------------------------------------------------------------------
def _ratings(n_users=5, n_items=150, per_user=30, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(n_users):
        items = rng.choice(n_items, per_user, replace=False)
        ts = rng.permutation(per_user) + 1000 * u
        rows += [
            (10 + u, 100 + int(i), 1 + int(rng.integers(0, 5)), int(t)) for i, t in zip(items, ts)
        ]
    return rows


def test_movielens_formats_parse_alike(tmp_path):
    rows = _ratings()
    (tmp_path / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r}.0,{t}\n" for u, i, r, t in rows)
    )
    (tmp_path / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows))
    (tmp_path / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    (tmp_path / "x.inter").write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
        + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows)
    )
    expected = np.array([(u, i, t) for u, i, _, t in rows])
    for name in ("ratings.csv", "ratings.dat", "u.data", "x.inter"):
        assert np.array_equal(D.read_ratings(tmp_path / name), expected), name
    with pytest.raises(ValueError, match="header"):
        D.parse_ratings("user,item\n1,2\n", "csv")


def test_ml100k_standin():
    r = D.recbole_ml100k()
    assert r.shape == (100_000, 3)
    assert len(np.unique(r[:, 0])) == 943 and len(np.unique(r[:, 1])) == 1682


class _Oracle(nn.Module):
    """Scores the held-out item of each user `sign`, everything else 0."""

    def __init__(self, held: dict[int, int], sign: float):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.held, self.sign = held, sign

    def forward(self, users, items):
        target = torch.tensor([self.held[int(u)] for u in users])
        return (items == target).float() * self.sign + self.w


def test_ncf_leave_one_out_protocol(tmp_path):
    rows = _ratings(n_users=10, n_items=300)
    (tmp_path / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in rows)
    )
    task = tasks.build_task(
        "movielens_ncf", data="canonical", data_root=str(tmp_path), batch_size=20
    )
    data = task.interactions()
    assert data.num_users == 10 and data.num_items <= 300
    # The held-out item is each user's latest rating.
    for u in range(10):
        mine = [(t, i) for uu, i, _, t in rows if uu == 10 + u]
        latest_raw = max(mine)[1]
        items_sorted = sorted({i for _, i, _, _ in rows})
        assert items_sorted[int(data.test_items[u])] == latest_raw
    assert len(data.train_users) == 10 * 29
    # The 99 evaluation negatives are never items the user interacted with.
    assert data.eval_negatives.shape == (10, 99)
    users = data.test_users[:, None].expand(-1, 99)
    assert not data.is_known(users.reshape(-1), data.eval_negatives.reshape(-1)).any()
    # Training batches: positives labelled 1, sampled negatives labelled 0 and unseen.
    for users_b, items_b, labels in task.train_batches(0, 1, 0):
        known = data.is_known(users_b, items_b)
        assert torch.equal(known, labels.bool())
    assert task.num_train() == 10 * 29 * 5
    held = {int(u): int(i) for u, i in zip(data.test_users, data.test_items)}
    assert task.evaluate(_Oracle(held, +1.0))["hr@10"] == 1.0
    assert task.evaluate(_Oracle(held, -1.0))["hr@10"] == 0.0
    with pytest.raises(ValueError, match="eval_negatives"):
        tasks.build_task(
            "movielens_ncf", data="canonical", data_root=str(tmp_path), eval_negatives=290
        ).interactions()


# -- extreme classification ------------------------------------------------------------------------
XML_TEXT = "3 6 4\n0,2 0:1.0 3:0.5\n 1:2.0 5:1.0\n3 2:0.25\n"


def test_xml_sparse_format(tmp_path):
    xml = D.parse_xml_sparse(XML_TEXT.splitlines(True))
    assert len(xml) == 3 and (xml.num_features, xml.num_labels) == (6, 4)
    assert xml.label_ptr.tolist() == [0, 2, 2, 3] and xml.label_idx.tolist() == [0, 2, 3]
    assert xml.feat_ptr.tolist() == [0, 2, 4, 5] and xml.feat_idx.tolist() == [0, 3, 1, 5, 2]
    assert xml.feat_val.tolist() == [1.0, 0.5, 2.0, 1.0, 0.25]
    with pytest.raises(ValueError, match="header says 4 points"):
        D.parse_xml_sparse(["4 6 4\n"] + XML_TEXT.splitlines(True)[1:])
    with pytest.raises(ValueError, match="label index"):
        D.parse_xml_sparse(["1 6 4\n", "9 0:1\n"])
    with pytest.raises(ValueError, match="num_points num_features num_labels"):
        D.parse_xml_sparse(["0,1 2:3\n"])


def test_xml_task_batches_and_hashing(tmp_path):
    for split in ("train", "test"):
        (tmp_path / f"{split}.txt").write_text(XML_TEXT)
    task = tasks.build_task("wiki10_xml", data="canonical", data_root=str(tmp_path), batch_size=3)
    x, y = task.fixed_batch()
    assert x.shape == (3, 256) and y.shape == (3, 4)
    xml = task.splits()[0]
    order = task.epoch_indices(0, 1, 0)[0]
    for row, point in enumerate(order.tolist()):
        labels = xml.label_idx[xml.label_ptr[point] : xml.label_ptr[point + 1]].tolist()
        assert y[row].nonzero().squeeze(1).tolist() == sorted(labels)
    # The hashed embedding is a fixed signed projection of the dense input, L2-normalised.
    h = task.hasher()
    dense = torch.zeros(3, 6)
    for p in range(3):
        for k in range(int(xml.feat_ptr[p]), int(xml.feat_ptr[p + 1])):
            dense[p, xml.feat_idx[k]] = xml.feat_val[k]
    proj = torch.zeros(6, 256)
    proj[torch.arange(6), h.bucket] = h.sign
    assert torch.allclose(
        h(xml, torch.arange(3)), torch.nn.functional.normalize(dense @ proj, dim=1)
    )
    model = task.build_model()
    assert model.weight.shape == (4, 256) and model.bias is None
    assert 0.0 <= task.evaluate(model)["p@1"] <= 1.0


def test_xml_movielens_standin():
    train, test = tasks.build_task("wiki10_xml").splits()
    assert train.num_labels == train.num_features == 1682
    assert 5_000 < len(train) and 1_000 < len(test)
    assert torch.all(train.label_ptr[1:] - train.label_ptr[:-1] == 10)
    assert torch.all(train.feat_ptr[1:] - train.feat_ptr[:-1] == 20)


# -- SST-2 and SQuAD -------------------------------------------------------------------------------
def test_sst2_tsv(tmp_path):
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / name).write_text(
            "sentence\tlabel\nit 's a charming journey . \t1\n"
            "the plot is thin \t0\nan utterly tedious mess \t0\n"
            "a gem of a film \t1\n"
        )
    sents, labels = D.read_sst2_tsv(tmp_path / "train.tsv")
    assert sents[0] == "it 's a charming journey . " and labels == [1, 0, 0, 1]
    task = tasks.build_task("roberta_sst2", data="canonical", data_root=str(tmp_path), batch_size=2)
    ids, mask, y = task.fixed_batch()
    assert (
        ids.shape == mask.shape
        and ids.shape[0] == 2
        and ids.shape[1] <= task.hparams["max_seq_length"]
    )
    assert set(y.tolist()) <= {0, 1} and int(mask[:, -1].max()) == 1  # trimmed to the longest
    torch.manual_seed(0)
    assert 0.0 <= task.evaluate(task.build_model())["accuracy"] <= 1.0
    (tmp_path / "bad.tsv").write_text("sentence\tlabel\nfine\t2\n")
    with pytest.raises(ValueError, match="label '2'"):
        D.read_sst2_tsv(tmp_path / "bad.tsv")


def test_author_passages_standin():
    from tasks.transformers_tasks import author_passages

    p = D.memo(("author-passages",), author_passages)
    for split in ("train", "test"):
        texts, labels = p[split]
        assert labels.count(0) == labels.count(1) > (200 if split == "test" else 2000)
        assert all(12 <= len(t.split()) <= 40 for t in texts)


SQUAD = {
    "version": "1.1",
    "data": [
        {
            "title": "T1",
            "paragraphs": [
                {
                    "context": "The quick brown fox jumps over the lazy dog near Paris in 1999.",
                    "qas": [
                        {
                            "id": "q1",
                            "question": "Where is the dog?",
                            "answers": [{"text": "near Paris", "answer_start": 44}],
                        },
                        {
                            "id": "q2",
                            "question": "When?",
                            "answers": [
                                {"text": "1999", "answer_start": 58},
                                {"text": "in 1999", "answer_start": 55},
                            ],
                        },
                    ],
                }
            ],
        },
        {
            "title": "T2",
            "paragraphs": [
                {
                    "context": "Alice met Bob. " * 80 + "Carol left at noon.",
                    "qas": [
                        {
                            "id": "q3",
                            "question": "Who left?",
                            "answers": [{"text": "Carol", "answer_start": 1200}],
                        }
                    ],
                }
            ],
        },
    ],
}


def test_squad_json_and_features(tmp_path):
    for name in ("train-v1.1.json", "dev-v1.1.json"):
        (tmp_path / name).write_text(json.dumps(SQUAD))
    exs = D.read_squad_json(tmp_path / "train-v1.1.json")
    assert [e["id"] for e in exs] == ["q1", "q2", "q3"] and exs[1]["answers"] == ["1999", "in 1999"]
    task = tasks.build_task("bert_squad", data="canonical", data_root=str(tmp_path), batch_size=2)
    f = task.features()["train"]
    assert int(f["example"].max()) == 2 and len(f["start"]) > 3  # the long context overflows
    for k in range(len(f["start"])):  # every answer-holding window decodes back to the answer
        s, e = int(f["start"][k]), int(f["end"][k])
        ex = exs[int(f["example"][k])]
        if s == 0:
            continue
        assert (
            ex["context"][int(f["offsets"][k, s, 0]) : int(f["offsets"][k, e, 1])]
            == ex["answers"][0]
        )
    assert sum(int(s) > 0 for s in f["start"]) >= 3
    torch.manual_seed(0)
    ev = task.evaluate(task.build_model())
    assert 0.0 <= ev["exact_match"] <= ev["f1"] <= 1.0
    bad = json.loads(json.dumps(SQUAD))
    bad["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="not at character 3"):
        D.read_squad_json(tmp_path / "bad.json")


def test_squad_metric_and_span_search():
    from tasks.transformers_tasks import best_spans, squad_f1, squad_normalize

    assert squad_normalize("The  Cat, sat!") == "cat sat"
    assert squad_f1("the cat sat", "cat sat") == 1.0
    assert squad_f1("a dog", "cat") == 0.0
    assert squad_f1("cat sat on", "cat sat") == pytest.approx(0.8)
    start = torch.tensor([[9.0, 0.0, 5.0, 1.0, 0.0, 0.0]])
    end = torch.tensor([[9.0, 0.0, 0.0, 2.0, 0.0, 4.0]])
    valid = torch.tensor([[False, True, True, True, True, True]])  # position 0 is [CLS]
    score, s, e = best_spans(start, end, valid, max_answer=4)
    assert (int(s), int(e)) == (2, 5) and float(score) == 9.0
    score, s, e = best_spans(start, end, valid, max_answer=2)  # 2..5 too long now
    assert (int(s), int(e)) == (2, 3)


def test_speaker_question_standin():
    from tasks.transformers_tasks import speaker_questions

    works = D.shakespeare_works()
    qa = speaker_questions({k: works[k] for k in list(works)[:3]})
    assert len(qa) > 500
    for q in qa:
        start, ans = q["starts"][0], q["answers"][0]
        assert q["context"][start : start + len(ans) + 1] == ans + "."
        quote = q["question"][len('Who says "') : -2]
        assert q["context"].count(quote) == 1
    task = tasks.build_task("bert_squad")
    ex = task.examples()
    assert {q["work"] for q in ex["train"]}.isdisjoint({q["work"] for q in ex["test"]})


def test_install_script_is_valid_bash():
    script = Path(__file__).resolve().parents[2] / "scripts" / "install_data.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
