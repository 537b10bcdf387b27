"""Training data: readers, chat-template loss masks, datasets, bucketed resumable batches, self-distillation."""

import collections
import copy
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest

from clover_jax.training.config import DataConfig
from clover_jax.training import data as D



@pytest.fixture(scope="module")
def tok():
    from clover_jax.io.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def sharegpt():
    return D.read_sharegpt(limit=300)


def conv(cid, *turns):
    roles = {"s": "system", "u": "user", "a": "assistant"}
    return D.Conversation(cid, tuple({"role": roles[r], "content": c} for r, c in turns))


def masked_runs(ids, mask):
    """Contiguous runs of masked token ids."""
    runs, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


# ---------------------------------------------------------------------------------------------- ShareGPT
def test_sharegpt_truncated_file_walk():
    path = D.sharegpt_path()
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8"))  # the trap: the file is cut off mid-record
    t0 = time.perf_counter()
    n = 0
    for rec in D.iter_json_array(path):
        n += 1
        assert set(rec) == {"id", "conversations"}
    if time.perf_counter() - t0 < 15:
        assert n == 17_671
    else:
        assert n > 10_000


def test_read_sharegpt_prefix(sharegpt):
    for c in sharegpt:
        roles = [m["role"] for m in c.messages]
        assert set(roles) <= {"system", "user", "assistant"}
        assert [r for r in roles if r != "system"][0] == "user"  # a leading assistant turn is dropped
        assert roles[-1] == "assistant"
        assert all(isinstance(m["content"], str) for m in c.messages)
    assert len({c.id for c in sharegpt}) > 290
    dropped = collections.Counter()
    again = D.read_sharegpt(limit=300, dropped=dropped)
    assert again == sharegpt and sum(dropped.values()) > 0  # some records have no turns at all
    assert len(sharegpt) == 300 and dropped["kept, with a turn holding no text"] > 0  # kept, counted


def test_role_normalisation(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "gpt", "value": "leading reply"}, {"from": "human", "value": "q1"},
                                      {"from": "chatgpt", "value": "r1"}, {"from": "user", "value": "q2"},
                                      {"from": "bing", "value": "r2"}, {"from": "human", "value": "q3"},
                                      {"from": "bard", "value": "r3"}, {"from": "human", "value": "unanswered"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q"},
                                      {"from": "gpt", "value": "r"}]},
        {"id": "no-assistant", "conversations": [{"from": "human", "value": "q"}]},
        {"id": "empty", "conversations": []},
        {"id": "weird", "conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "r"}]},
    ]
    text = json.dumps(records, indent=1)
    path = tmp_path / "chats.json"
    path.write_text(text[: len(text) - 40])  # cut off inside the last record, like the PyPI file
    dropped = collections.Counter()
    convs = D.read_chat_file(path, dropped=dropped)
    assert [c.id for c in convs] == ["a", "b"]
    assert [m["role"] for m in convs[0].messages] == ["user", "assistant"] * 3
    assert [m["content"] for m in convs[0].messages] == ["q1", "r1", "q2", "r2", "q3", "r3"]
    assert [m["role"] for m in convs[1].messages] == ["system", "user", "assistant"]
    assert dropped == {"no assistant turn": 1, "empty": 1}  # "weird" was truncated away
    path.write_text(json.dumps(records))
    dropped.clear()
    assert len(D.read_chat_file(path, dropped=dropped)) == 2 and dropped["unknown role"] == 1


def test_openai_jsonl_and_hf_dataset(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"r{i}"}]} for i in range(3)]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    convs = D.read_chat_file(path)
    assert [c.messages[2]["content"] for c in convs] == ["r0", "r1", "r2"] and convs[0].id == "0"
    assert D.read_chat_file(path, limit=2) == convs[:2]
    import gzip

    gz = tmp_path / "chats.jsonl.gz"  # compressed (how self-distilled replies are kept in the repository)
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert D.read_chat_file(gz) == convs and D.load_conversations(DataConfig(source=str(gz))) == convs

    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"id": f"x{i}", **r} for i, r in enumerate(rows)]).save_to_disk(str(tmp_path / "ds"))
    hf = D.read_hf_dataset(tmp_path / "ds")
    assert [c.id for c in hf] == ["x0", "x1", "x2"] and [c.messages for c in hf] == [c.messages for c in convs]
    cfg = DataConfig(source=str(tmp_path / "ds"), system_prompt="other")
    assert D.load_conversations(cfg)[0].messages[0]["content"] == "s"  # has a system turn already


def test_a_list_of_sources_is_read_in_order_and_capped_in_total(tmp_path):
    def write(name, ids):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"q {i}"},
                                                                  {"role": "assistant", "content": f"r {i}"}]}) + "\n"
                                for i in ids))
        return str(path)

    a, b = write("a.jsonl", ["a0", "a1", "a2"]), write("b.jsonl", ["b0", "b1"])
    assert [c.id for c in D.load_conversations(DataConfig(source=[a, b]))] == ["a0", "a1", "a2", "b0", "b1"]
    assert [c.id for c in D.load_conversations(DataConfig(source=[b, a], num_conversations=3))] == ["b0", "b1", "a0"]
    # the cap reached inside the first source: the second is not read (it may be missing or still being written)
    assert [c.id for c in D.load_conversations(DataConfig(source=[a, str(tmp_path / "later.jsonl")],
                                                          num_conversations=2))] == ["a0", "a1"]
    # the same conversation twice could land on both sides of the id-hash split: refused, naming both files
    with pytest.raises(D.DataError, match=r"'a1' is in both .*a\.jsonl.* and .*dup\.jsonl"):
        D.load_conversations(DataConfig(source=[a, write("dup.jsonl", ["x", "a1"])]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"id": "e", "messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(D.DataError, match=r"data.source=.*empty\.jsonl.*no conversations left"):
        D.load_conversations(DataConfig(source=[a, str(empty)]))
    from clover_jax.training.config import ConfigError

    for bad, why in (([], "must not be an empty list"), ([a, a], "lists a source twice"),
                     ([a, "x.csv"], "unknown source kind 'x.csv'"), ([a, " "], "must not be empty")):
        with pytest.raises(ConfigError, match=why):
            DataConfig(source=bad)


def test_load_conversations_sharegpt_and_system_prompt(sharegpt):
    convs = D.load_conversations(DataConfig(num_conversations=50, system_prompt="Be brief."))
    assert len(convs) == 50 and [c.id for c in convs] == [c.id for c in sharegpt[:50]]
    sys_msg = {"role": "system", "content": "Be brief."}
    for c, orig in zip(convs, sharegpt):
        has_system = orig.messages[0]["role"] == "system"
        assert c.messages == (orig.messages if has_system else (sys_msg,) + orig.messages)


def test_read_questions(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text('{"question_id": 1, "category": "writing", "turns": ["a", "b"]}\n'
                    '{"question_id": 2, "category": "math", "turns": ["c"]}\n')
    assert D.read_questions(path) == [{"question_id": 1, "category": "writing", "turns": ["a", "b"]},
                                      {"question_id": 2, "category": "math", "turns": ["c"]}]
    assert [q["question_id"] for q in D.read_questions(path, category="math")] == [2]
    with pytest.raises(D.DataError, match="no questions in category 'coding'"):
        D.read_questions(path, category="coding")
    from clover_jax.io.prompts import questions_path

    qs = D.read_questions(questions_path("mt_bench"))  # shipped with the package
    assert len(qs) == 80 and all(len(q["turns"]) == 2 for q in qs)
    assert len({q["category"] for q in qs}) == 8
    assert len(D.read_questions(questions_path("spec_bench"))) == 480


def test_sharegpt_heldout_questions_were_never_trained_or_self_distilled_on():
    """The shipped ShareGPT question set is what it claims: 80 first turns of conversations outside the first
    16,000 usable ones (all any config or self-distillation run reads) and outside the kept self-distilled replies."""
    import gzip

    from clover_jax.io.prompts import questions_path, read_prompts

    qs = D.read_questions(questions_path("sharegpt_heldout"))
    assert len(qs) == 80 and len(read_prompts("sharegpt_heldout")) == 80
    ids = {q["question_id"] for q in qs}
    assert len(ids) == 80
    assert not ids & {c.id for c in D.read_sharegpt(limit=16000)}
    kept = Path(D.__file__).resolve().parents[2] / "data" / "self_distill" / "smollm2-135m-instruct-sharegpt.jsonl.gz"
    with gzip.open(kept, "rt") as f:
        assert not ids & {json.loads(line)["id"] for line in f}


def test_bad_bytes_and_empty_turns_in_training_files(tmp_path, caplog):
    """A line that is not UTF-8 names its file and line (plain, gzip-compressed and JSON-array files); a gzip file cut
    short is named; a conversation with a turn holding no text is kept, counted and warned about."""
    import gzip

    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]})
    path = tmp_path / "chats.jsonl"
    path.write_bytes((good + "\n" + good + "\n").encode() + b'{"messages": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"chats\.jsonl:3: not UTF-8") as e:
        D.read_chat_file(path)
    assert isinstance(e.value, ValueError) and "Traceback" not in str(e.value)
    gz = tmp_path / "chats.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(ValueError, match=r"chats\.jsonl\.gz:3: not UTF-8"):
        D.read_chat_file(gz)
    whole = gzip.compress("".join(f'{{"id": "{i}", "messages": []}}\n' for i in range(400)).encode())
    gz.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"chats\.jsonl\.gz: not a whole gzip file"):
        D.read_chat_file(gz)
    arr = tmp_path / "chats.json"
    arr.write_bytes(b"[\n" + good.encode() + b",\n" + b'{"id": "\xff"}]')
    with pytest.raises(ValueError, match=r"chats\.json:3: not UTF-8"):
        D.read_chat_file(arr)
    empty = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  \n"}]
    special = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<|endoftext|> "}]
    path.write_text("\n".join([good, json.dumps({"messages": empty}), good, json.dumps({"messages": special})]) + "\n")
    with caplog.at_level("WARNING"):
        convs = D.load_conversations(DataConfig(source=str(path)))
    assert len(convs) == 4 and "kept, with a turn holding no text: 2" in caplog.text


def test_missing_and_unknown_files(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        D.read_chat_file(missing)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        D.load_conversations(DataConfig(source=str(missing)))
    with pytest.raises(FileNotFoundError, match="dataset folder not found"):
        D.load_conversations(DataConfig(source=str(tmp_path / "no_dir")))
    bad = tmp_path / "bad.json"
    bad.write_text('[{"prompt": "x", "completion": "y"}]')
    with pytest.raises(D.DataError, match="unknown format.*neither 'conversations'"):
        D.read_chat_file(bad)
    bad.write_text('{"data": []}')
    with pytest.raises(D.DataError, match="unknown format, expected a JSON array"):
        D.read_chat_file(bad)


def test_empty_after_filtering(tmp_path, tok):
    path = tmp_path / "only_users.jsonl"
    path.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n{"conversations": []}\n')
    with pytest.raises(D.DataError, match=r"no conversations left after filtering.*'no assistant turn': 1.*'empty': 1"):
        D.load_conversations(DataConfig(source=str(path)))
    convs = [conv("a", ("u", "hello " * 200), ("a", "reply"))]
    with pytest.raises(D.DataError, match="data.min_assistant_tokens=1 .* data.max_length=64"):
        D.build_datasets(DataConfig(max_length=64, heldout_fraction=0.0), tok, convs)


# ------------------------------------------------------------------------------------------- loss masks
def test_loss_mask_hand_made(tok):
    c = conv("x", ("u", "What is 2+2?"), ("a", "2+2 equals 4."), ("u", "And 3+3?"), ("a", "It is 6, of course."))
    ids, mask = D.tokenize_conversation(tok, c.messages)
    assert ids.dtype == np.int32 and mask.dtype == np.int32 and ids.shape == mask.shape
    assert tok.decode(ids) == tok.apply_chat_template(list(c.messages), tokenize=False)
    runs = [tok.decode(r) for r in masked_runs(ids, mask)]
    assert runs == ["2+2 equals 4.<|im_end|>", "It is 6, of course.<|im_end|>"]
    unmasked = tok.decode(ids[mask == 0])
    assert "What is 2+2?" in unmasked and "And 3+3?" in unmasked
    assert "SmolLM" in unmasked  # the template's default system prompt: present, not learned
    assert unmasked.count("<|im_start|>assistant\n") == 2  # the assistant header is not learned
    # The end-of-turn token of each assistant turn is learned, the newline after it is not.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ends = np.flatnonzero(ids == im_end)
    assert mask[ends].tolist() == [0, 0, 1, 0, 1]  # system, user, assistant, user, assistant
    assert mask[ends[-1] + 1] == 0


def test_loss_mask_with_system_and_no_default(tok):
    c = conv("x", ("s", "You are terse."), ("u", "Hi"), ("a", "Hello."))
    ids, mask = D.tokenize_conversation(tok, c.messages)
    assert "SmolLM" not in tok.decode(ids)
    assert tok.decode(ids[mask == 1]) == "Hello.<|im_end|>"


def test_loss_mask_other_template(tok):
    """A template that trims content and ends turns with a different special token."""
    t = copy.deepcopy(tok)
    t.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] | trim }}\n"
                       "{% elif m['role'] == 'assistant' %}Bot: {{ m['content'] | trim }}<|endoftext|>\n"
                       "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}")
    c = conv("x", ("u", "  Hi "), ("a", "  Hello there.  "), ("u", "Bye"), ("a", "Bye!"))
    ids, mask = D.tokenize_conversation(t, c.messages)
    assert [t.decode(r) for r in masked_runs(ids, mask)] == [" Hello there.<|endoftext|>", " Bye!<|endoftext|>"]
    # " Hello" is one token that starts on the header's space: it is what the model generates after "Bot:".


def test_template_that_is_not_prefix_stable(tok):
    t = copy.deepcopy(tok)
    t.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(D.DataError, match="not a prefix"):
        D.tokenize_conversation(t, conv("x", ("u", "a"), ("a", "b")).messages)
    t.chat_template = None
    with pytest.raises(D.DataError, match="no chat template"):
        D.tokenize_conversation(t, conv("x", ("u", "a"), ("a", "b")).messages)


def test_loss_mask_real_sharegpt(tok, sharegpt):
    """On real conversations, every learned run is one assistant reply + <|im_end|>, in order."""
    checked = 0
    for c in sharegpt[:40]:
        ids, mask = D.tokenize_conversation(tok, c.messages)
        replies = [m["content"] for m in c.messages if m["role"] == "assistant"]
        runs = [tok.decode(r) for r in masked_runs(ids, mask)]
        assert len(runs) == len(replies)
        for run, reply in zip(runs, replies):
            assert run == reply + "<|im_end|>"
        unmasked = tok.decode(ids[mask == 0])
        for m in c.messages:
            if m["role"] != "assistant":
                assert m["content"] in unmasked  # every user/system token is left out of the loss
        checked += 1
    assert checked == 40


def test_truncation(tok, sharegpt):
    c = conv("x", ("u", "Tell me a long story."), ("a", "Once upon a time " * 50))
    full_ids, full_mask = D.tokenize_conversation(tok, c.messages)
    ids, mask = D.tokenize_conversation(tok, c.messages, max_length=40)
    assert len(ids) == 40 and np.array_equal(ids, full_ids[:40]) and np.array_equal(mask, full_mask[:40])
    assert mask[-1] == 1
    # Long real conversations: the fast path (encode only a prefix) equals truncating the full encoding.
    longest = sorted(sharegpt, key=lambda c: -sum(len(m["content"]) for m in c.messages))[:8]
    for c in longest:
        full_ids, full_mask = D.tokenize_conversation(tok, c.messages)
        for n in (64, 512):
            ids, mask = D.tokenize_conversation(tok, c.messages, max_length=n)
            assert np.array_equal(ids, full_ids[:n]) and np.array_equal(mask, full_mask[:n])


# ---------------------------------------------------------------------------------------------- datasets
@pytest.fixture(scope="module")
def dataset(tok, sharegpt):
    cfg = DataConfig(max_length=256, heldout_fraction=0.1, batch_size=4)
    return D.build_datasets(cfg, tok, sharegpt[:120])


def test_split_deterministic_and_disjoint(sharegpt):
    a = D.split_conversations(sharegpt, 0.1, seed=0)
    b = D.split_conversations(sharegpt, 0.1, seed=0)
    c = D.split_conversations(sharegpt, 0.1, seed=1)
    assert a == b and a != c
    train, held = a
    assert len(held) == 30 and len(train) == 270
    assert {id(x) for x in train}.isdisjoint({id(x) for x in held})
    assert sorted(map(id, train + held)) == sorted(map(id, sharegpt))  # a partition of the conversations
    assert D.split_conversations(sharegpt, 0.1, shuffle=False) == (list(sharegpt[:270]), list(sharegpt[270:]))
    assert D.split_conversations(sharegpt, 0.0)[1] == []


def test_split_by_id_hash_keeps_each_conversation_on_its_side_as_the_data_grows(sharegpt):
    small_train, small_held = D.split_conversations(sharegpt[:150], 0.1, seed=0, by="id_hash")
    big_train, big_held = D.split_conversations(sharegpt, 0.1, seed=0, by="id_hash")
    assert {c.id for c in small_held} <= {c.id for c in big_held}
    assert {c.id for c in small_train} <= {c.id for c in big_train}
    assert sorted(map(id, big_train + big_held)) == sorted(map(id, sharegpt))
    assert 15 <= len(big_held) <= 45  # ~10% of 300 (40 measured; binomial sd 5)
    other = D.split_conversations(sharegpt, 0.1, seed=1, by="id_hash")[1]
    assert {c.id for c in other} != {c.id for c in big_held}
    shuffled = D.split_conversations(sharegpt, 0.1, seed=0, by="shuffle")[1]
    assert {c.id for c in shuffled} != {c.id for c in big_held}
    with pytest.raises(ValueError, match="expected 'shuffle' or 'id_hash'"):
        D.split_conversations(sharegpt, 0.1, by="random")
    # a second reply to a conversation (`X/t0.7`, sampled) lands on X's side, whichever side that is
    twins = [dataclasses.replace(c, id=c.id + "/t0.7") for c in sharegpt]
    twin_train, twin_held = D.split_conversations(list(sharegpt) + twins, 0.1, seed=0, by="id_hash")
    assert {c.id for c in twin_held} == {c.id for c in big_held} | {c.id + "/t0.7" for c in big_held}
    assert len(twin_train) == 2 * len(big_train)


def test_tokenized_dataset(dataset, tok, sharegpt):
    train, held = dataset
    assert train.stats["conversations"] == 108 and held.stats["conversations"] == 12
    assert len(train) + train.stats["dropped_few_assistant_tokens"] == 108
    assert train.stats["truncated"] > 0 and train.stats["max_length"] <= 256
    assert train.pad_id == tok.pad_token_id == 2
    for ex in train:
        assert len(ex) <= 256 and ex.num_loss_tokens >= 1
    again, _ = D.build_datasets(DataConfig(max_length=256, heldout_fraction=0.1), tok, sharegpt[:120])
    assert again.fingerprint() == train.fingerprint() and again.stats == train.stats


def test_min_assistant_tokens_filter(tok):
    convs = [conv("short", ("u", "hi"), ("a", "ok")), conv("long", ("u", "hi"), ("a", "a longer reply than that"))]
    ds = D.TokenizedDataset.from_conversations(convs, tok, 128, min_assistant_tokens=4)
    assert [e.id for e in ds] == ["long"] and ds.stats["dropped_few_assistant_tokens"] == 1


def test_auto_boundaries():
    assert D.auto_boundaries(512) == (64, 128, 256, 512)
    assert D.auto_boundaries(300) == (64, 128, 256, 300)
    assert D.auto_boundaries(2048)[-1] == 2048 and len(D.auto_boundaries(2048)) == 6


def test_bucketing(dataset):
    train, _ = dataset
    b = D.BucketedBatcher(train, 4, "auto", seed=0)
    assert b.boundaries == (64, 128, 256)
    seen = []
    real = padded = 0
    for length, rows in b.epoch_plan(0):
        lower = b.boundaries[b.boundaries.index(length) - 1] if length != b.boundaries[0] else 0
        for i in rows[rows >= 0]:
            assert lower < train.lengths[i] <= length  # the smallest bucket that fits
        seen += rows[rows >= 0].tolist()
        real += int(train.lengths[rows[rows >= 0]].sum())
        padded += length * len(rows)
    assert sorted(seen) == list(range(len(train)))  # each example exactly once per epoch
    assert b.padding_waste() == pytest.approx(1 - real / padded)
    assert 0 < b.padding_waste() < 0.5
    assert b.stats()["examples_per_bucket"] == np.bincount(b.bucket_of, minlength=3).tolist()
    single = D.BucketedBatcher(train, 4, [256], seed=0)
    assert single.boundaries == (256,) and single.padding_waste() >= b.padding_waste()
    custom = D.BucketedBatcher(train, 4, [100, 200, 1000], seed=0)
    assert custom.boundaries == (100, 200, 256)  # the dataset's max_length closes the list


def test_batch_content(dataset):
    train, _ = dataset
    b = D.BucketedBatcher(train, 4, "auto", seed=0)
    length, rows = b.epoch_plan(0)[0]
    batch = next(b)
    assert set(batch) == {"tokens", "loss_mask", "valid"}
    assert batch["tokens"].shape == (4, length) and batch["tokens"].dtype == np.int32
    assert batch["loss_mask"].dtype == np.int32 and batch["valid"].dtype == bool
    for r, i in enumerate(rows):
        if i < 0:
            assert not batch["valid"][r].any() and not batch["loss_mask"][r].any()
            continue
        ex, n = train[int(i)], len(train[int(i)])
        assert np.array_equal(batch["tokens"][r, :n], ex.tokens) and (batch["tokens"][r, n:] == train.pad_id).all()
        assert np.array_equal(batch["loss_mask"][r, :n], ex.loss_mask) and not batch["loss_mask"][r, n:].any()
        assert batch["valid"][r, :n].all() and not batch["valid"][r, n:].any()


def test_partial_batches(dataset):
    train, _ = dataset
    b = D.BucketedBatcher(train, 4, "auto", seed=0)
    d = D.BucketedBatcher(train, 4, "auto", seed=0, drop_remainder=True)
    filler = sum(int((rows < 0).sum()) for _, rows in b.epoch_plan(0))
    assert filler > 0 and all((rows >= 0).all() for _, rows in d.epoch_plan(0))
    assert d.batches_per_epoch < b.batches_per_epoch


def test_deterministic_order(dataset):
    train, _ = dataset
    a, b = D.BucketedBatcher(train, 4, seed=3), D.BucketedBatcher(train, 4, seed=3)
    first = [next(a)["tokens"] for _ in range(5)]
    assert all(np.array_equal(x, next(b)["tokens"]) for x in first)
    order = lambda bt, e: [tuple(r) for _, r in bt.epoch_plan(e)]  # noqa: E731
    assert order(a, 0) != order(a, 1)  # a new order each epoch
    assert order(a, 0) != order(D.BucketedBatcher(train, 4, seed=4), 0)


def test_resume(dataset):
    train, _ = dataset
    a = D.BucketedBatcher(train, 4, seed=0)
    n = a.batches_per_epoch
    for _ in range(n - 3):
        next(a)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON round trip (checkpoint metadata)
    expected = [next(a) for _ in range(8)]  # crosses into epoch 1
    assert a.epoch == 1
    b = D.BucketedBatcher(train, 4, seed=0)
    b.load_state_dict(state)
    for want in expected:
        got = next(b)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(D.DataError, match="cannot resume the batcher: seed"):
        D.BucketedBatcher(train, 4, seed=1).load_state_dict(state)
    sub = D.TokenizedDataset(train.examples[1:], train.pad_id, train.max_length)
    with pytest.raises(D.DataError, match="cannot resume the batcher: fingerprint"):
        D.BucketedBatcher(sub, 4, seed=0).load_state_dict(state)


def test_process_slices(dataset):
    train, _ = dataset
    whole = D.BucketedBatcher(train, 4, seed=0)
    parts = [D.BucketedBatcher(train, 4, seed=0, process_index=p, process_count=2) for p in range(2)]
    for _ in range(3):
        w, p0, p1 = next(whole), next(parts[0]), next(parts[1])
        assert p0["tokens"].shape[0] == 2
        assert np.array_equal(np.concatenate([p0["tokens"], p1["tokens"]]), w["tokens"])


# -------------------------------------------------------------------------------------- self-distillation
class FakeGenerate:
    def __init__(self, fail_after=None):
        self.calls, self.fail_after = [], fail_after

    def __call__(self, prompts, max_new_tokens=None):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.calls.append([p[-1]["content"] for p in prompts])
        self.max_new_tokens = max_new_tokens
        return [f"reply to {p[-1]['content']}" for p in prompts]


def test_self_distill_resume(tmp_path):
    convs = [conv(f"c{i}", ("s", "sys"), ("u", f"question {i:02d}"), ("a", "old"), ("u", "more"), ("a", "old2"))
             for i in range(10)]
    convs.append(conv("dup", ("s", "sys"), ("u", "question 03"), ("a", "other")))  # same prompt as c3
    out = tmp_path / "sd" / "cache.jsonl"
    first = FakeGenerate(fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        D.build_self_distill(convs, first, out, batch_size=3, max_new_tokens=17, progress=False)
    assert sum(len(c) for c in first.calls) == 6 and first.max_new_tokens == 17
    with out.open("a") as f:
        f.write('{"key": "half a rec')  # killed mid-write
    second = FakeGenerate()
    result = D.build_self_distill(convs, second, out, batch_size=3, max_new_tokens=17, progress=False)
    done_first = {q for call in first.calls for q in call}
    asked_second = [q for call in second.calls for q in call]
    assert sorted(asked_second) == sorted({f"question {i:02d}" for i in range(10)} - done_first)
    assert len(asked_second) == 4  # each distinct prompt once, only the missing ones
    assert len(D.SelfDistillCache(out)) == 10
    assert [len(c.messages) for c in result] == [3] * 11
    for c in result:
        assert c.messages[:2] == ({"role": "system", "content": "sys"}, c.messages[1])
        assert c.messages[2] == {"role": "assistant", "content": f"reply to {c.messages[1]['content']}"}
    assert result[-1].id == "dup" and result[-1].messages[2]["content"] == "reply to question 03"
    third = FakeGenerate()
    assert D.build_self_distill(convs, third, out, progress=False) == result and third.calls == []
    D.build_self_distill(convs[:2], third, out, resume=False, progress=False)
    assert len(third.calls) == 1 and len(D.SelfDistillCache(out)) == 2


def test_self_distill_stopped_early_leaves_a_sample_of_all_lengths_not_the_shortest(tmp_path):
    """A generation stopped after a fifth of the prompts (the usual case: it is slow) holds prompts of every
    length, each batch sorted by length (little padding), and a resumed run finishes the rest once each."""
    import random

    words = [f"w{i:03d}" for i in range(200)]  # one width: characters grow with words
    rng = random.Random(0)
    convs = [conv(f"c{i}", ("u", " ".join(rng.choices(words, k=n))), ("a", "old")) for i, n in enumerate(range(1, 161))]
    length = {c.messages[0]["content"]: i + 1 for i, c in enumerate(convs)}  # words per prompt: 1..160
    gen = FakeGenerate(fail_after=8)
    with pytest.raises(KeyboardInterrupt):
        D.build_self_distill(convs, gen, tmp_path / "c.jsonl", batch_size=4, progress=False)
    done = [length[p] for batch in gen.calls for p in batch]  # 32 of 160 prompts
    assert len(done) == 32 and min(done) <= 20 and max(done) >= 140  # shortest-first would stop at 32 words
    assert sum(n > 80 for n in done) >= 8  # the long half is represented, not a handful of strays
    for batch in gen.calls:
        assert [length[p] for p in batch] == sorted(length[p] for p in batch)
    rest = FakeGenerate()
    D.build_self_distill(convs, rest, tmp_path / "c.jsonl", batch_size=4, progress=False)
    assert sorted(done + [length[p] for batch in rest.calls for p in batch]) == list(range(1, 161))


def test_self_distill_stopped_early_with_another_seed_starts_on_other_prompts(tmp_path):
    """Two short sampled runs (seeds 0 and 3, a reply each) begin on different prompts, so together they cover more
    of the set; seed 0 keeps the order the replies kept in the repository were generated in."""
    convs = [conv(f"c{i}", ("u", f"question {i:03d}"), ("a", "old")) for i in range(120)]
    firsts = {}
    for seed in (0, 3, 4):
        gen = FakeGenerate(fail_after=3)
        with pytest.raises(KeyboardInterrupt):
            D.build_self_distill(convs, gen, tmp_path / f"s{seed}.jsonl", batch_size=4, progress=False, seed=seed)
        firsts[seed] = {p for batch in gen.calls for p in batch}
        assert len(firsts[seed]) == 12
    assert len(firsts[0] & firsts[3]) <= 6 and firsts[3] != firsts[4]  # 1.2 shared by chance
    from clover_jax.training.distill_cache import generation_order, prompt_key

    todo = [(c.id, c.messages[:1]) for c in convs]
    by_key = [i for i, _ in sorted(todo, key=lambda item: prompt_key(item[1]))]  # the order before the seed
    for seed, same in ((0, True), (3, False)):
        order = [i for i, _ in generation_order(todo, 4, seed=seed)]  # windows of 32 sorted by length
        assert sorted(order) == sorted(by_key)
        assert all((set(order[s:s + 32]) == set(by_key[s:s + 32])) == same for s in (0, 32, 64))


def test_self_distill_generate_fn_without_max_new_tokens(tmp_path):
    seen = []

    def gen(prompts):
        seen.append(len(prompts))
        return ["x"] * len(prompts)

    convs = [conv(f"c{i}", ("u", f"q{i}"), ("a", "a")) for i in range(5)]
    D.build_self_distill(convs, gen, tmp_path / "c.jsonl", batch_size=2, progress=False)
    assert seen == [2, 2, 1]
    with pytest.raises(D.DataError, match="returned 1 replies for 2 prompts"):
        D.build_self_distill([conv("z", ("u", "new"), ("a", "a")), conv("y", ("u", "new2"), ("a", "a"))],
                             lambda p: ["only one"], tmp_path / "c.jsonl", batch_size=2, progress=False)


def test_self_distill_chat_file_round_trip_seeds_a_fresh_cache(tmp_path):
    """The replies kept in the repository (an exported chat file) seed the cache of a fresh machine: only the
    prompts they lack are generated."""
    from clover_jax.training.self_distill import export_chat_file, import_chat_file

    convs = [conv(f"c{i}", ("u", f"question {i} é"), ("a", "old")) for i in range(6)]
    D.build_self_distill(convs[:4], FakeGenerate(), tmp_path / "old.jsonl", progress=False)
    assert export_chat_file(tmp_path / "old.jsonl", tmp_path / "kept.jsonl.gz") == 4
    fresh = tmp_path / "fresh" / "replies.jsonl"
    assert import_chat_file(tmp_path / "kept.jsonl.gz", fresh, max_new_tokens=17) == 4
    assert import_chat_file(tmp_path / "kept.jsonl.gz", fresh) == 0  # already there
    gen = FakeGenerate()
    result = D.build_self_distill(convs, gen, fresh, progress=False)
    assert gen.calls == [["question 4 é", "question 5 é"]]
    assert [c.messages[-1]["content"] for c in result] == [f"reply to question {i} é" for i in range(6)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": "no reply"}]}) + "\n")
    with pytest.raises(D.DataError, match="line 1: the last message is not an assistant reply"):
        import_chat_file(bad, tmp_path / "other.jsonl")


def test_exported_ids_take_a_suffix_once(tmp_path):
    """Sampled replies to the same conversations are exported as `X/t0.7` (trainable beside the greedy `X`); a
    cache seeded from such a file does not suffix them twice."""
    from clover_jax.training.self_distill import export_chat_file, import_chat_file

    convs = [conv(f"c{i}", ("u", f"question {i}"), ("a", "old")) for i in range(3)]
    D.build_self_distill(convs[:2], FakeGenerate(), tmp_path / "a.jsonl", progress=False)
    assert export_chat_file(tmp_path / "a.jsonl", tmp_path / "t.jsonl", id_suffix="/t0.7") == 2
    ids = lambda path: [json.loads(line)["id"] for line in open(path)]  # noqa: E731
    assert ids(tmp_path / "t.jsonl") == ["c0/t0.7", "c1/t0.7"]
    import_chat_file(tmp_path / "t.jsonl", tmp_path / "b.jsonl")
    D.build_self_distill(convs, FakeGenerate(), tmp_path / "b.jsonl", progress=False)  # adds c2 only
    export_chat_file(tmp_path / "b.jsonl", tmp_path / "t2.jsonl", id_suffix="/t0.7")
    assert ids(tmp_path / "t2.jsonl") == ["c0/t0.7", "c1/t0.7", "c2/t0.7"]


def test_prompt_files_leave_out_evaluation_questions_and_answered_prompts(tmp_path, tok):
    """`--export-prompts`: the prompts a generation run on another machine answers. Never a prompt of a
    conversation that a sharegpt_heldout question comes from (any part `X_n` of it) or an MT-Bench question's
    text; never one a kept chat file already answers (`--skip-answered`); each prompt once."""
    import gzip

    from clover_jax.io.prompts import read_prompts
    from clover_jax.training.self_distill import evaluation_exclusions, export_prompts_file

    held = json.loads(Path("clover_jax/data/sharegpt_heldout.jsonl").read_text().splitlines()[0])
    base = held["question_id"].rsplit("_", 1)[0]
    mt = read_prompts("mt_bench", limit=1)[0]
    convs = [conv(f"{base}_99", ("u", "another part of a held-out conversation"), ("a", "r")),
             conv("mt_1", ("u", mt), ("a", "r")),
             conv("ok_0", ("u", "kept question"), ("a", "r")), conv("ok_1", ("u", "kept question"), ("a", "r2")),
             conv("done_0", ("u", "answered already"), ("a", "r")),
             conv("new_0", ("s", "Be brief."), ("u", "hi"), ("a", "r")),
             conv("long_0", ("u", "word " * 400), ("a", "r"))]
    answered = tmp_path / "kept.jsonl.gz"
    with gzip.open(answered, "wt") as f:
        f.write(json.dumps({"id": "x", "messages": [{"role": "user", "content": "answered already"},
                                                    {"role": "assistant", "content": "an answer"}]}) + "\n")
    ids, texts = evaluation_exclusions()
    assert base in ids and mt.strip() in texts and len(ids) > 50
    out = tmp_path / "prompts.jsonl.gz"
    assert export_prompts_file(convs, tok, 256, out, skip_answered=[answered]) == 2
    rows = [json.loads(line) for line in gzip.open(out, "rt")]
    assert [r["id"] for r in rows] == ["ok_0", "new_0"]
    assert rows[1]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "-"}]
    assert export_prompts_file(convs, tok, 256, tmp_path / "all.jsonl") == 3  # the answered one is back


def test_self_distillation_temperature_reaches_the_generator(monkeypatch, tmp_path):
    """`data.self_distill_temperature` > 0 samples the replies (seeded by data.seed); 0 is greedy; < 0 refused."""
    from clover_jax.training.config import ConfigError
    from clover_jax.training import self_distill as SD

    seen = {}
    make_generate_fn = lambda loaded, **kw: seen.update(kw) or FakeGenerate()  # noqa: E731
    monkeypatch.setattr(SD, "short_prompts", lambda convs, tok, n: convs)

    class Cfg:
        data = DataConfig(self_distill_temperature=0.7, seed=3)
        self_distill_dir = str(tmp_path)

    loaded = type("Loaded", (), {"tokenizer": None})
    out = SD.self_distilled_conversations(Cfg, loaded, make_generate_fn, convs=[conv("a", ("u", "q"), ("a", "r"))],
                                          progress=False)
    assert seen == {"temperature": 0.7, "seed": 3, "mesh": None}
    assert out[0].messages[-1]["content"] == "reply to q"
    with pytest.raises(ConfigError, match="self_distill_temperature"):
        DataConfig(self_distill_temperature=-1.0)


def test_self_distillation_on_several_hosts_is_a_clear_error(monkeypatch):
    """Every host would decode every prompt alone and write the same cache: refused with what to do instead."""
    import jax

    from clover_jax.training.self_distill import self_distilled_conversations

    monkeypatch.setattr(jax, "process_count", lambda: 4)
    with pytest.raises(D.DataError, match="runs in one process, not 4: generate the replies on one host"):
        self_distilled_conversations(None, None, None)
