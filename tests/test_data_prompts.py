import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data.prompts import DataError, PromptOrder, load_prompts
from tiny_models import tiny_tokenizer

TOK = tiny_tokenizer()


def rows(n=3):
    return [{"data_source": "nq", "prompt": [{"role": "user", "content": f"question {i}"}],
             "reward_model": {"style": "rule", "ground_truth": {"target": [f"a{i}"]}}, "extra_info": {"index": i}}
            for i in range(n)]


def test_parquet_and_jsonl_rows(tmp_path):
    pq.write_table(pa.Table.from_pylist(rows()), tmp_path / "t.parquet")
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows(2)) + "\n")
    records, dropped = load_prompts([str(tmp_path / "t.parquet"), str(tmp_path / "t.jsonl")], TOK, max_prompt_length=64)
    assert len(records) == 5 and dropped == 0
    assert records[1].prompt_ids == TOK.encode("question 1", add_special_tokens=False)  # no chat template: contents
    assert records[1].ground_truth == {"target": ["a1"]} and records[1].data_source == "nq"
    assert [r.index for r in records] == [0, 1, 2, 3, 4]


def test_chat_template_and_length_filter(tmp_path):
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}<|im_start|>"
    data = rows(2)
    data[1]["prompt"] = "question " + "long " * 100
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in data))
    records, dropped = load_prompts([str(tmp_path / "t.jsonl")], tok, max_prompt_length=20)
    assert dropped == 1 and len(records) == 1
    assert tok.decode(records[0].prompt_ids) == "<|im_start|>question 0<|im_end|><|im_start|>"


@pytest.mark.parametrize("row, words", [
    ({"prompt": "q", "reward_model": {"ground_truth": "a"}}, "row 1: missing column 'data_source'"),
    ({"prompt": "q", "data_source": "nq", "reward_model": "a"}, "ground_truth"),
    ({"prompt": [], "data_source": "nq", "reward_model": {"ground_truth": "a"}}, "non-empty"),
])
def test_bad_rows_name_file_and_row(tmp_path, row, words):
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=words):
        load_prompts([str(tmp_path / "t.jsonl")], TOK, max_prompt_length=64)


GOOD_LINE = json.dumps(rows(1)[0]).encode()


@pytest.mark.parametrize("second_line, message", [
    # the byte counted by hand: {"prompt": " is 12 bytes, so the bad byte is the 13th
    (b'{"prompt": "\xff"}',
     "t.jsonl:2: not UTF-8 text (byte 0xff at byte 13 of the line); re-encode the file as UTF-8"),
    ('{"prompt": "café"}'.encode("latin-1"),
     "t.jsonl:2: not UTF-8 text (byte 0xe9 at byte 16 of the line); re-encode the file as UTF-8"),
    (b"{oops", "t.jsonl:2: not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
    (b'{"prompt": "q",', "t.jsonl:2: not valid JSON (Expecting property name enclosed in double quotes at column 16)"),
    (b"[1, 2]", "t.jsonl:2: a list, not a JSON object (one row per line)"),
])
def test_a_bad_jsonl_line_is_named_by_file_and_line(tmp_path, second_line, message):
    (tmp_path / "t.jsonl").write_bytes(GOOD_LINE + b"\n" + second_line + b"\n" + GOOD_LINE + b"\n")
    with pytest.raises(DataError) as error:
        load_prompts([str(tmp_path / "t.jsonl")], TOK, max_prompt_length=64)
    assert str(error.value) == f"{tmp_path}/{message}"


def test_a_byte_order_mark_is_not_an_error(tmp_path):
    (tmp_path / "t.jsonl").write_bytes(b"\xef\xbb\xbf" + GOOD_LINE + b"\n")
    records, _ = load_prompts([str(tmp_path / "t.jsonl")], TOK, max_prompt_length=64)
    assert len(records) == 1


class AsciiOnly:
    """A tokenizer with a token per ASCII character and none for anything else (no unknown
    token, no byte fallback): it drops what it cannot encode."""
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text if ord(c) < 128]


@pytest.mark.parametrize("prompt, tokenizer, message", [
    ("", TOK, "row 2: prompt is empty (''); give the prompt text or drop the row"),
    (" \n\t", TOK, "row 2: prompt is empty (' \\n\\t'); give the prompt text or drop the row"),
    ([], TOK, "row 2: prompt must be a non-empty string or a list of chat messages [{role, content}], got []"),
    (None, TOK, "row 2: prompt must be a non-empty string or a list of chat messages [{role, content}], got None"),
    ([{"role": "user", "content": ""}], TOK,
     "row 2: prompt: every message's content is empty; give the prompt text or drop the row"),
    ([{"role": "system", "content": " "}, {"role": "user", "content": "\n"}], TOK,
     "row 2: prompt: every message's content is empty; give the prompt text or drop the row"),
    ([{"role": "user"}], TOK,
     "row 2: prompt: message 0 must be {role, content} with a string content, got {'role': 'user'}"),
    ("\u200b\u200b", AsciiOnly(),  # two zero-width spaces: text to str.strip, nothing to this tokenizer
     "row 2: prompt '\\u200b\\u200b' is zero tokens once rendered; give the prompt text"),
])
def test_an_empty_prompt_is_refused_with_file_and_row(tmp_path, prompt, tokenizer, message):
    data = rows(2)
    data[1]["prompt"] = prompt
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in data) + "\n")
    with pytest.raises(DataError) as error:
        load_prompts([str(tmp_path / "t.jsonl")], tokenizer, max_prompt_length=64)
    assert str(error.value) == f"{tmp_path}/t.jsonl {message}"


def test_prompt_order_epochs_and_resume():
    straight = PromptOrder(5, seed=3)
    draws = [straight.take(3) for _ in range(4)]  # 12 draws over 3 epochs
    flat = [i for d in draws for i in d]
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))  # each epoch a permutation
    resumed = PromptOrder(5, seed=3)
    resumed.take(3), resumed.take(3)
    state = resumed.state_dict()
    fresh = PromptOrder(5, seed=3)
    fresh.load_state_dict(state)
    assert [fresh.take(3), fresh.take(3)] == draws[2:]
    assert PromptOrder(4, seed=0, shuffle=False).take(6) == [0, 1, 2, 3, 0, 1]
    with pytest.raises(DataError, match="same data and seed"):
        PromptOrder(6, seed=3).load_state_dict(state)
