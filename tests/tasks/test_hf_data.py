"""task data="hf": the papers' data sets in the Hugging Face `datasets` format.

Every data set here is built with `datasets.Dataset.from_dict` in the Hub set's schema
(column names, types and split names as `datasets.load_dataset` returns them) and saved
with `save_to_disk`; the tasks read it with `load_from_disk(data_root)`, or through a
stand-in for `datasets.load_dataset` that records its arguments. Where the task has a
canonical file loader, the same rows written in the canonical format must give the
same tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

import tasks
from tasks import data as D
from tasks import hf_data
from tasks.base import DATA_KINDS

REPO = Path(__file__).resolve().parents[2]
HF_SOURCES = {
    "roberta_sst2": ("glue", "sst2"),
    "gpt2_sst2": ("glue", "sst2"),
    "bert_squad": ("squad", "plain_text"),
    "wikitext2_lstm": ("wikitext", "wikitext-2-v1"),
    "ptb_lstm": ("ptb_text_only", "penn_treebank"),
}

# -- the Hub sets' schemas -------------------------------------------------------------------------
SST2_FEATURES = datasets.Features(
    {
        "sentence": datasets.Value("string"),
        "label": datasets.ClassLabel(names=["negative", "positive"]),
        "idx": datasets.Value("int32"),
    }
)
SQUAD_FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "title": datasets.Value("string"),
        "context": datasets.Value("string"),
        "question": datasets.Value("string"),
        "answers": datasets.Sequence(
            {"text": datasets.Value("string"), "answer_start": datasets.Value("int32")}
        ),
    }
)
WIKITEXT_FEATURES = datasets.Features({"text": datasets.Value("string")})
PTB_FEATURES = datasets.Features({"sentence": datasets.Value("string")})

POSITIVE = ["a charming journey", "a gem of a film", "warm and funny", "simply wonderful"]
NEGATIVE = ["the plot is thin", "an utterly tedious mess", "dull and lifeless", "a waste"]


def _sst2_split(n: int, hidden_labels: bool = False) -> datasets.Dataset:
    sentences = [(POSITIVE if i % 2 else NEGATIVE)[i % 4] + f" number {i}" for i in range(n)]
    labels = [-1] * n if hidden_labels else [i % 2 for i in range(n)]
    return datasets.Dataset.from_dict(
        {"sentence": sentences, "label": labels, "idx": list(range(n))}, features=SST2_FEATURES
    )


def _sst2(root: Path, validation_hidden: bool = False) -> Path:
    """GLUE SST-2's layout: train, validation, and a test split whose labels are -1."""
    datasets.DatasetDict(
        {
            "train": _sst2_split(24),
            "validation": _sst2_split(10, hidden_labels=validation_hidden),
            "test": _sst2_split(6, hidden_labels=True),
        }
    ).save_to_disk(str(root))
    return root


def _forget(root: Path) -> None:
    """Drop this process's memoised data for `root`, so the next task reads it again."""
    for key in [k for k in D._MEMO if str(root) in repr(k)]:
        del D._MEMO[key]


def _train_steps(task, steps: int = 3) -> list[float]:
    torch.manual_seed(0)
    model = task.build_model()
    opt = task.make_optimizer(model.parameters())
    losses = []
    for batch in list(task.train_batches(0, 1, 0))[:steps]:
        loss = task.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert len(losses) == steps and all(torch.isfinite(torch.tensor(losses)))
    return losses


# -- which tasks have a source ---------------------------------------------------------------------
def test_hf_sources_are_the_task_files_blocks():
    assert "hf" in DATA_KINDS
    assert tasks.hf_tasks() == sorted(HF_SOURCES)
    for name in tasks.list_tasks():
        block = hf_data.file_block(name)
        cls = tasks.get_task_class(name)
        assert bool(block) == bool(cls.hf_splits) == (name in HF_SOURCES), name
        if name in HF_SOURCES:
            assert (block["name"], block["config"]) == HF_SOURCES[name]
            assert set(block) == set(hf_data.FIELDS)
            assert all(c for c in cls.hf_columns) and set(cls.hf_splits) <= {
                "train",
                "valid",
                "test",
            }


@pytest.mark.parametrize("name", ["cifar10_resnet20", "movielens_ncf", "wiki10_xml"])
def test_tasks_without_a_source_refuse_hf(name):
    with pytest.raises(ValueError, match="no Hugging Face data set source") as exc:
        tasks.build_task(name, data="hf", hf={"name": "anything"})
    assert "bert_squad, gpt2_sst2, ptb_lstm, roberta_sst2, wikitext2_lstm" in str(exc.value)
    with pytest.raises(ValueError, match="no Hugging Face data set source"):
        tasks.get_task_class(name)(data="hf")  # the class itself refuses too


def test_movielens_refusal_says_why():
    with pytest.raises(ValueError, match="redistribution"):
        tasks.build_task("movielens_ncf", data="hf")


@pytest.mark.slow
def test_import_tasks_does_not_import_datasets():
    code = (
        "import sys, tasks; tasks.list_tasks(); tasks.hf_tasks(); "
        "tasks.get_task_class('roberta_sst2'); "
        "assert 'datasets' not in sys.modules, 'datasets imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_hf_is_ignored_for_the_other_data_kinds(tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / f"ptb.{split}.txt").write_text(" the cat sat on the mat \n" * 40)
    task = tasks.build_task(
        "ptb_lstm", data="canonical", data_root=str(tmp_path), hf={"name": "elsewhere"}
    )
    assert task.hf_source is None and task.data_source.startswith("Penn Treebank (ptb.")


# -- SST-2 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["roberta_sst2", "gpt2_sst2"])
@pytest.mark.slow
def test_sst2_from_a_saved_copy_trains(tmp_path, name):
    root = _sst2(tmp_path / "sst2")
    task = tasks.build_task(name, data="hf", data_root=str(root), batch_size=4)
    assert "GLUE SST-2" in task.data_source and str(root) in task.data_source
    enc = task.encoded()
    tok = task.tokenizer()
    train = datasets.load_from_disk(str(root))["train"]
    # Row i of the training tensors is the tokenised sentence i with its label.
    ids, mask, labels = enc["train"]
    assert labels.tolist() == list(train["label"])
    for i in (0, 7, 23):
        n = int(mask[i].sum())
        assert ids[i, :n].tolist() == tok(train[i]["sentence"])["input_ids"]
    # Evaluation reads validation (10 rows, labels 0/1), never the hidden-label test split.
    assert len(enc["test"][2]) == 10 and set(enc["test"][2].tolist()) == {0, 1}
    _train_steps(task)
    acc = task.evaluate(task.build_model())["accuracy"]
    assert 0.0 <= acc <= 1.0


@pytest.mark.slow
def test_sst2_tokenisation_is_cached_next_to_the_data(tmp_path):
    root = _sst2(tmp_path / "sst2")
    first = tasks.build_task("roberta_sst2", data="hf", data_root=str(root)).encoded()
    caches = sorted(p.name for p in (root / "train").glob("cache-*.arrow"))
    assert len(caches) == 1
    _forget(root)
    again = tasks.build_task("roberta_sst2", data="hf", data_root=str(root)).encoded()
    assert sorted(p.name for p in (root / "train").glob("cache-*.arrow")) == caches
    for split in ("train", "test"):
        assert all(torch.equal(a, b) for a, b in zip(first[split], again[split]))
    # Another sequence length is another tokenisation, cached beside the first.
    _forget(root)
    tasks.build_task(
        "roberta_sst2", data="hf", data_root=str(root), hparams={"max_seq_length": 8}
    ).encoded()
    assert len(list((root / "train").glob("cache-*.arrow"))) == 2


@pytest.mark.slow
def test_sst2_evaluation_split_with_hidden_labels_is_refused(tmp_path):
    root = _sst2(tmp_path / "sst2", validation_hidden=True)
    task = tasks.build_task("roberta_sst2", data="hf", data_root=str(root))
    with pytest.raises(ValueError, match=r"labels \[-1\], not 0/1"):
        task.encoded()


def test_load_dataset_gets_the_task_files_source_or_the_override(tmp_path, monkeypatch):
    saved = datasets.load_from_disk(str(_sst2(tmp_path / "sst2")))
    calls = []

    def fake_load_dataset(name, config=None, revision=None):
        calls.append((name, config, revision))
        return saved

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = tasks.build_task("roberta_sst2", data="hf", batch_size=4)
    assert calls == [("glue", "sst2", None)]
    assert task.hf_source.load_call() == "datasets.load_dataset('glue', 'sst2')"
    assert task.fixed_batch()[0].shape[0] == 4
    override = {"name": "nyu-mll/glue", "config": None, "revision": "abc123"}
    task = tasks.build_task("gpt2_sst2", data="hf", hf=override)
    assert calls[-1] == ("nyu-mll/glue", "sst2", "abc123")  # None keeps the file's config
    assert task.hf_source.load_call() == (
        "datasets.load_dataset('nyu-mll/glue', 'sst2', revision='abc123')"
    )
    with pytest.raises(ValueError, match=r"hf\.nmae is not a key.*allowed: name, config"):
        tasks.build_task("roberta_sst2", data="hf", hf={"nmae": "glue"})
    with pytest.raises(ValueError, match=r"hf\.config=3 must be a non-empty string"):
        tasks.build_task("roberta_sst2", data="hf", hf={"config": 3})


def test_paper_size_with_hf_data_uses_the_paper_model(tmp_path):
    root = _sst2(tmp_path / "sst2")
    task = tasks.build_task("roberta_sst2", size="paper", data="hf", data_root=str(root))
    assert task.uses_hub_model and task.tokenizer_name() == "roberta-base"
    assert "roberta-base (pretrained)" in task.data_source


# -- SQuAD -----------------------------------------------------------------------------------------
CTX1 = "The quick brown fox jumps over the lazy dog near Paris in 1999."
CTX2 = "Alice met Bob. " * 80 + "Carol left at noon."
SQUAD_ROWS = [
    ("q1", "T1", CTX1, "Where is the dog?", ["near Paris"], [44]),
    ("q2", "T1", CTX1, "When?", ["1999", "in 1999"], [58, 55]),
    ("q3", "T2", CTX2, "Who left?", ["Carol"], [1200]),
]


def _squad_rows(n_train: int) -> list[tuple]:
    """The three examples above, then short ones up to n_train rows (past datasets.map's
    1000-row batch, so example indices cross a batch boundary)."""
    rows = list(SQUAD_ROWS)
    for i in range(len(rows), n_train):
        who = ("Ann", "Ben", "Cy")[i % 3]
        ctx = f"In year {1900 + i} {who} wrote book {i}."
        rows.append((f"g{i}", "Gen", ctx, f"Who wrote book {i}?", [who], [ctx.index(who)]))
    return rows


def _squad_dataset(rows) -> datasets.Dataset:
    cols = ("id", "title", "context", "question")
    table = {c: [r[k] for r in rows] for k, c in enumerate(cols)}
    table["answers"] = [{"text": r[4], "answer_start": r[5]} for r in rows]
    return datasets.Dataset.from_dict(table, features=SQUAD_FEATURES)


def _squad_json(rows) -> dict:
    return {
        "version": "1.1",
        "data": [
            {
                "title": r[1],
                "paragraphs": [
                    {
                        "context": r[2],
                        "qas": [
                            {
                                "id": r[0],
                                "question": r[3],
                                "answers": [
                                    {"text": t, "answer_start": s} for t, s in zip(r[4], r[5])
                                ],
                            }
                        ],
                    }
                ],
            }
            for r in rows
        ],
    }


# Windows a third of the smoke size's 192 tokens: a third of the tensors to build and
# compare, and CTX2 still spans several windows (8 instead of 3).
WINDOWS = {"max_seq_length": 64, "doc_stride": 16}


@pytest.mark.slow
def test_squad_from_a_saved_copy_matches_the_json_loader(tmp_path):
    train_rows = _squad_rows(1040)
    root = tmp_path / "squad"
    datasets.DatasetDict(
        {"train": _squad_dataset(train_rows), "validation": _squad_dataset(SQUAD_ROWS)}
    ).save_to_disk(str(root))
    task = tasks.build_task("bert_squad", data="hf", data_root=str(root), batch_size=4,
                            hparams=WINDOWS)
    assert "SQuAD 1.1" in task.data_source
    jdir = tmp_path / "json"
    jdir.mkdir()
    (jdir / "train-v1.1.json").write_text(json.dumps(_squad_json(train_rows)))
    (jdir / "dev-v1.1.json").write_text(json.dumps(_squad_json(SQUAD_ROWS)))
    canonical = tasks.build_task("bert_squad", data="canonical", data_root=str(jdir), batch_size=4,
                                 hparams=WINDOWS)
    for split in ("train", "test"):
        got, want = task.features()[split], canonical.features()[split]
        assert set(got) == set(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert task.examples()["test"] == canonical.examples()["test"]
    f = task.features()["train"]
    exs = task.examples()["train"]
    assert int(f["example"].max()) == len(train_rows) - 1  # past the first map batch
    checked = 0
    for k in range(len(f["start"])):  # every answer-holding window decodes to its answer
        s, e = int(f["start"][k]), int(f["end"][k])
        if s == 0:
            continue
        ex = exs[int(f["example"][k])]
        assert (
            ex["context"][int(f["offsets"][k, s, 0]) : int(f["offsets"][k, e, 1])]
            == (ex["answers"][0])
        )
        checked += 1
    assert checked >= len(train_rows)
    _train_steps(task)
    ev = task.evaluate(task.build_model(), max_batches=1)
    assert 0.0 <= ev["exact_match"] <= ev["f1"] <= 1.0


def test_squad_answer_off_its_position_is_refused(tmp_path):
    rows = list(SQUAD_ROWS)
    rows[0] = rows[0][:5] + ([3],)
    root = tmp_path / "squad"
    datasets.DatasetDict(
        {"train": _squad_dataset(rows), "validation": _squad_dataset(rows)}
    ).save_to_disk(str(root))
    task = tasks.build_task("bert_squad", data="hf", data_root=str(root))
    with pytest.raises(ValueError, match="'near Paris' is not at character 3"):
        task.features()


# -- word-level language models --------------------------------------------------------------------
WIKI_LINES = {
    "train": ["", " = Valkyria = \n", "", " the cat sat on the mat , 1 @,@ 000 times \n"] * 20
    + [" a <unk> dog ran \n"] * 10,
    "validation": ["", " = Other = \n", " the dog sat \n"] * 8,
    "test": [" a cat ran on the mat \n", ""] * 12,
}
PTB_LINES = {
    "train": [" aer banknote berlitz calloway \n", " pierre <unk> N years old \n"] * 40,
    "validation": [" consumers may want to move \n"] * 10,
    "test": [" no it was n't black monday \n"] * 12,
}


def _save_lines(root: Path, lines: dict, column: str, features) -> Path:
    datasets.DatasetDict(
        {s: datasets.Dataset.from_dict({column: v}, features=features) for s, v in lines.items()}
    ).save_to_disk(str(root))
    return root


def _write_files(folder: Path, lines: dict, names: dict) -> Path:
    folder.mkdir()
    for theirs, fname in names.items():
        text = "".join(ln if ln.endswith("\n") else ln + "\n" for ln in lines[theirs])
        (folder / fname).write_text(text)
    return folder


@pytest.mark.parametrize(
    "name, column, features, lines, kind, files",
    [
        (
            "wikitext2_lstm",
            "text",
            WIKITEXT_FEATURES,
            WIKI_LINES,
            "wikitext2",
            {
                "train": "wiki.train.tokens",
                "validation": "wiki.valid.tokens",
                "test": "wiki.test.tokens",
            },
        ),
        (
            "ptb_lstm",
            "sentence",
            PTB_FEATURES,
            PTB_LINES,
            "ptb",
            {"train": "ptb.train.txt", "validation": "ptb.valid.txt", "test": "ptb.test.txt"},
        ),
    ],
)
def test_language_model_corpus_matches_the_text_files(
    tmp_path, name, column, features, lines, kind, files
):
    root = _save_lines(tmp_path / "hf", lines, column, features)
    task = tasks.build_task(name, data="hf", data_root=str(root), batch_size=2, hparams={"bptt": 5})
    corpus = task.corpus()
    canonical = D.load_word_corpus(_write_files(tmp_path / "files", lines, files), kind)
    assert corpus.itos == canonical.itos
    for split in ("train", "valid", "test"):
        assert torch.equal(corpus.ids[split], canonical.ids[split]), split
    # One row, one line: "<eos>" closes every row, empty rows included.
    eos = corpus.stoi["<eos>"]
    assert int((corpus.ids["train"] == eos).sum()) == len(lines["train"])
    _train_steps(task)
    ppl = task.evaluate(task.build_model(), max_batches=2)["perplexity"]
    assert 1.0 < ppl < 10 * len(corpus)


# -- missing or malformed data sets ----------------------------------------------------------------
def test_missing_saved_copy_gives_one_message_with_the_fetch_command(tmp_path):
    root = tmp_path / "not-there"
    with pytest.raises(FileNotFoundError) as exc:
        tasks.build_task("roberta_sst2", data="hf", data_root=str(root))
    msg = str(exc.value)
    assert exc.value.__cause__ is None and exc.value.__suppress_context__
    assert f"task.data_root={root}" in msg
    assert (
        f"python -c \"import datasets; datasets.load_dataset('glue', 'sst2')"
        f".save_to_disk('{root}')\"" in msg
    )


@pytest.mark.slow
def test_missing_hub_data_set_offline_gives_one_message(tmp_path):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_DATASETS_CACHE": str(tmp_path / "empty-cache"),
    }
    code = (
        "import tasks\n"
        "try:\n"
        "    tasks.build_task('bert_squad', data='hf')\n"
        "except FileNotFoundError as e:\n"
        "    assert e.__cause__ is None and e.__suppress_context__\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    msg = out.stdout
    assert "datasets.load_dataset('squad', 'plain_text') failed" in msg
    assert (
        "import datasets; datasets.load_dataset('squad', 'plain_text')"
        ".save_to_disk('/path/to/copy')" in msg
    )
    assert "task.data_root=/path/to/copy" in msg and "HF_DATASETS_CACHE" in msg


def test_malformed_copies_name_what_is_missing(tmp_path):
    one_split = tmp_path / "one"
    _sst2_split(8).save_to_disk(str(one_split))
    with pytest.raises(ValueError, match="single Dataset, not the DatasetDict"):
        tasks.build_task("roberta_sst2", data="hf", data_root=str(one_split))
    no_validation = tmp_path / "noval"
    datasets.DatasetDict({"train": _sst2_split(8)}).save_to_disk(str(no_validation))
    with pytest.raises(ValueError, match=r"lacks split\(s\) validation \(it holds train\)"):
        tasks.build_task("gpt2_sst2", data="hf", data_root=str(no_validation))
    line_features = datasets.Features({"line": datasets.Value("string")})
    wrong_column = _save_lines(tmp_path / "wiki", WIKI_LINES, "line", line_features)
    with pytest.raises(ValueError, match=r"lacks column\(s\) text \(it has line\)"):
        tasks.build_task("wikitext2_lstm", data="hf", data_root=str(wrong_column))


def test_a_text_task_reads_its_text_column_only():
    from tasks import language

    class Subtitles(language.WikiText2LSTM):
        hf_text = "line"

    assert Subtitles.hf_columns == ("line",)
    assert language.PTBLSTM.hf_columns == ("sentence",)
    assert language.WikiText2LSTM.hf_columns == ("text",)
