"""megarl.data.prompts at its edges: the length limit's boundary, drops counted past the first,
the corpus a parquet file records, rendering with and without a chat template, and the order's
epochs."""

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers.processors import TemplateProcessing

from megarl.data.prompts import CORPUS_METADATA, DataError, PromptOrder, data_corpus, load_prompts, read_rows, render_prompt
from tiny_models import tiny_tokenizer

TOK = tiny_tokenizer()


def row(prompt, **reward):
    return {"data_source": "nq", "prompt": prompt, "reward_model": reward or {"ground_truth": "a"}}


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("reward", [{"style": "rule"}, ["ground_truth"], "ground_truth"])
def test_a_reward_model_without_its_ground_truth_is_named(tmp_path, reward):
    path = jsonl(tmp_path / "t.jsonl", [{"data_source": "nq", "prompt": "q", "reward_model": reward}])
    with pytest.raises(DataError) as error:
        load_prompts([path], TOK, max_prompt_length=64)
    assert str(error.value) == f"{path} row 1: reward_model must be a mapping with 'ground_truth'"


def test_the_length_limit_keeps_a_prompt_of_exactly_that_many_tokens_and_counts_every_drop(tmp_path, caplog):
    sizes = {text: len(TOK.encode(text, add_special_tokens=False)) for text in ("a b c", "a b c d e", "a b c d e f g")}
    limit = sizes["a b c d e"]
    assert sizes["a b c"] < limit < sizes["a b c d e f g"]
    path = jsonl(tmp_path / "t.jsonl", [row("a b c d e f g"), row("a b c d e"), row("a b c d e f g"), row("a b c")])
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
        records, dropped = load_prompts([path], TOK, max_prompt_length=limit, apply_chat_template=False)
    assert dropped == 2 and [len(r.prompt_ids) for r in records] == [limit, sizes["a b c"]]
    assert [r.getMessage() for r in caplog.records] == [
        f"dropped 2 prompts longer than data.max_prompt_length={limit} tokens"]


def test_no_prompt_short_enough_is_an_error_naming_the_files(tmp_path):
    path = jsonl(tmp_path / "t.jsonl", [row("a b c d e f g")])
    with pytest.raises(DataError) as error:
        load_prompts([path], TOK, max_prompt_length=1)
    assert str(error.value) == f"no usable prompts in {[path]} (dropped 1 as too long)"


def test_read_rows_takes_json_files_skips_blank_lines_and_names_what_it_refuses(tmp_path):
    (tmp_path / "t.json").write_text('{"a": 1}\n\n   \n{"a": 2}\n')
    assert read_rows(tmp_path / "t.json") == [{"a": 1}, {"a": 2}]
    with pytest.raises(DataError) as error:
        read_rows(tmp_path / "none.jsonl")
    assert str(error.value) == f"data file {tmp_path / 'none.jsonl'} not found"
    (tmp_path / "t.csv").write_text("a\n1\n")
    with pytest.raises(DataError) as error:
        read_rows(tmp_path / "t.csv")
    assert str(error.value) == f"{tmp_path / 't.csv'}: unsupported data file type '.csv'; use .parquet or .jsonl"


@pytest.mark.parametrize("line, message", [
    # columns counted by hand: '{"a": 1,' is 8 characters, then two spaces, so the name is looked for at column 11
    ('{"a": 1,  ', "not valid JSON (Expecting property name enclosed in double quotes at column 11)"),
    ('{"a": 1}X', "not valid JSON (Extra data at column 9)"),  # the 9th character, not stripped away
    ('\ufeff{"a": 1}', "not valid JSON (Unexpected UTF-8 BOM (decode using utf-8-sig) at column 1)"),  # a BOM past line 1
])
def test_a_bad_second_line_is_told_by_its_column(tmp_path, line, message):
    (tmp_path / "t.jsonl").write_text('{"a": 0}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError) as error:
        read_rows(tmp_path / "t.jsonl")
    assert str(error.value) == f"{tmp_path / 't.jsonl'}:2: {message}"


def test_the_corpus_a_parquet_file_records(tmp_path):
    rows = pa.Table.from_pylist([{"a": 1}])
    for name, metadata, expected in [
        ("recorded.parquet", {CORPUS_METADATA: b'{"name": "wiki", "rows": 3}'}, {"name": "wiki", "rows": 3}),
        ("none.parquet", None, None),
        ("other.parquet", {b"other": b"{}"}, None),
        ("list.parquet", {CORPUS_METADATA: b"[1, 2]"}, None),
        ("bad.parquet", {CORPUS_METADATA: b"{oops"}, None),
    ]:
        pq.write_table(rows.replace_schema_metadata(metadata), tmp_path / name)
        assert data_corpus(tmp_path / name) == expected, name
        assert data_corpus(str(tmp_path / name)) == expected, name
    (tmp_path / "t.jsonl").write_text('{"a": 1}\n')
    (tmp_path / "dir.parquet").mkdir()
    for path in (tmp_path / "t.jsonl", tmp_path / "missing.parquet", tmp_path / "dir.parquet"):
        assert data_corpus(path) is None


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_prompt_is_rendered_as_the_users_turn_with_the_assistants_turn_opened():
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    by_hand = "<|im_start|>user\nhow many?<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(tok, "how many?", True) == tok.encode(by_hand, add_special_tokens=False)
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how many?"}]
    assert render_prompt(tok, system, True) == tok.encode(
        "<|im_start|>system\nbe brief<|im_end|>\n" + by_hand, add_special_tokens=False)


def test_without_a_template_the_contents_are_joined_by_newlines():
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how many?"}]
    assert render_prompt(TOK, system, True) == TOK.encode("be brief\nhow many?", add_special_tokens=False)

    class NoTemplate:  # a tokenizer class without the attribute at all
        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    assert render_prompt(NoTemplate(), system, True) == [ord(c) for c in "be brief\nhow many?"]


def test_a_tokenizer_that_adds_a_bos_token_does_not_add_it_to_the_prompt():
    tok = tiny_tokenizer()  # with a post-processor that puts BOS in front, as Llama 3's does
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    assert tok.encode("a b")[0] == bos  # the encoder does add it by default
    assert render_prompt(tok, "a b", False) == tok.encode("a b")[1:]


def test_the_prompt_order_shuffles_by_default_and_starts_at_epoch_0():
    order = PromptOrder(10, seed=3)
    assert order.state_dict() == {"epoch": 0, "position": 0, "size": 10, "seed": 3}
    first = order.take(10)
    assert sorted(first) == list(range(10)) and first != list(range(10))  # 1 in 10! to be sorted by chance
    assert PromptOrder(10, seed=3, shuffle=False).take(10) == list(range(10))


def test_an_epoch_ends_on_its_last_prompt_and_epochs_count_by_one():
    order = PromptOrder(4, seed=0)
    order.take(4)
    assert order.state_dict()["epoch"] == 1 and order.state_dict()["position"] == 0
    order.take(8)
    assert order.state_dict()["epoch"] == 3 and order.state_dict()["position"] == 0
    each = [order.take(4) for _ in range(3)]  # epochs 3, 4 and 5 are each a permutation of their own
    assert all(sorted(e) == [0, 1, 2, 3] for e in each) and len({tuple(e) for e in each}) > 1
    assert np.array_equal(PromptOrder(4, seed=0).take(16)[12:], each[0])  # epoch 3, reached any way
