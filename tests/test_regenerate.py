"""`specforge regenerate` on the tiny toy target: the target's own replies, any format, resumable, refusals."""

import json

import pytest

from sf_helpers import run_specforge

from specforge_core.config import RegenerateOptions
from specforge_core.regenerate import RegenerateError, run_regenerate
from specforge_core.speculative import greedy_decode
from specforge_core.protocols import CapturePlan


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specforge_plugin_hf.toy import build_toy_target

    return build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)


@pytest.fixture(scope="module")
def engine(tiny):
    from specforge_plugin_hf import HFEngineOptions
    from specforge_plugin_hf.engine import HFTargetEngine

    return HFTargetEngine(HFEngineOptions(model=str(tiny)))


ROWS = [
    # with the old reply's tokens too, which data preparation would read first: regenerate drops them
    {"messages": [{"role": "user", "content": "Count from 3 to 6."}, {"role": "assistant", "content": "no."}],
     "id": "a", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
    {"conversations": [{"from": "human", "value": "Spell 'cat' backwards."}, {"from": "gpt", "value": "x"},
                       {"from": "human", "value": "How many letters are in 'walrus'?"}]},
    {"prompt": "What is 2 plus 3?"},
    "not json",
    {"input_ids": [1, 2], "loss_mask": [0, 1]},
    {"system": "Be brief.", "prompt": "Shout the word 'igloo'.", "completion": "old"},
]


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def greedy_reply(engine, messages, max_new_tokens):
    tok = engine.tokenizer
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    ids = greedy_decode(engine, prompt, CapturePlan(), max_new_tokens=max_new_tokens,
                        eos_token_id=engine.stop_token_ids())
    stopped = ids and ids[-1] in engine.stop_token_ids()
    return tok.decode(ids[:-1] if stopped else ids)


def cut_reply(engine, messages, max_new_tokens):
    """``{"finish_reason": "length"}`` when the target's greedy reply to ``messages`` reaches ``max_new_tokens``
    without a stop token, else ``{}``: how a regenerated reply is marked."""
    tok = engine.tokenizer
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    ids = greedy_decode(engine, prompt, CapturePlan(), max_new_tokens=max_new_tokens,
                        eos_token_id=engine.stop_token_ids())
    return {} if ids and ids[-1] in engine.stop_token_ids() else {"finish_reason": "length"}


def test_every_reply_is_the_targets_greedy_reply_in_the_rows_own_format(engine, tmp_path):
    source = write(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    report = run_regenerate(engine, str(source), str(out), RegenerateOptions(max_new_tokens=24, batch_size=2),
                            progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert (report.rows, report.written, report.turns) == (6, 4, 5)
    assert report.skipped == {"not JSON": 1, "pre-tokenized row (no text to regenerate)": 1}
    first, second, third, fourth = rows
    user = {"role": "user", "content": "Count from 3 to 6."}
    assert first == {"messages": [user, {"role": "assistant", "content": greedy_reply(engine, [user], 24),
                                         **cut_reply(engine, [user], 24)}], "id": "a"}
    # multi-turn: the second reply answers a conversation whose first reply is already the target's own
    h1 = {"role": "user", "content": "Spell 'cat' backwards."}
    r1 = greedy_reply(engine, [h1], 24)
    h2 = {"role": "user", "content": "How many letters are in 'walrus'?"}
    history = [h1, {"role": "assistant", "content": r1}, h2]
    r2 = greedy_reply(engine, history, 24)
    assert second == {"conversations": [{"from": "human", "value": h1["content"]},
                                        {"from": "gpt", "value": r1, **cut_reply(engine, [h1], 24)},
                                        {"from": "human", "value": h2["content"]},
                                        {"from": "gpt", "value": r2, **cut_reply(engine, history, 24)}]}
    question = [{"role": "user", "content": "What is 2 plus 3?"}]
    assert third == {"prompt": "What is 2 plus 3?", "response": greedy_reply(engine, question, 24),
                     **cut_reply(engine, question, 24)}
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Shout the word 'igloo'."}]
    assert fourth == {"system": "Be brief.", "prompt": "Shout the word 'igloo'.",
                      "completion": greedy_reply(engine, system, 24), **cut_reply(engine, system, 24)}
    assert report.cut == 5  # the tiny target stops no reply within 24 tokens: each is marked as cut
    assert not (tmp_path / "out.jsonl.partial").exists() and not (tmp_path / "out.jsonl.partial.json").exists()


def test_an_interrupted_run_continues_after_its_last_batch_without_regenerating_anything(engine, tmp_path):
    source = write(tmp_path / "in.jsonl", [ROWS[0], ROWS[2], ROWS[0], ROWS[2]])
    whole = tmp_path / "whole.jsonl"
    options = RegenerateOptions(max_new_tokens=12, batch_size=1)
    run_regenerate(engine, str(source), str(whole), options, progress=False)

    calls = []
    real_generate = engine.generate

    class Killed(Exception):
        pass

    def dies_on_the_third_batch(prompts, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise Killed()
        return real_generate(prompts, **kwargs)

    out = tmp_path / "out.jsonl"
    engine.generate = dies_on_the_third_batch
    try:
        with pytest.raises(Killed):
            run_regenerate(engine, str(source), str(out), options, progress=False)
    finally:
        del engine.generate
    assert not out.exists() and (tmp_path / "out.jsonl.partial").read_text().count("\n") == 2
    counted = []
    engine.generate = lambda prompts, **kwargs: counted.append(len(prompts)) or real_generate(prompts, **kwargs)
    try:
        report = run_regenerate(engine, str(source), str(out), options, progress=False)
    finally:
        del engine.generate
    assert counted == [1, 1] and (report.rows, report.resumed_after_line) == (2, 2)  # only the last two rows
    assert out.read_text() == whole.read_text()


def test_refusals_name_the_file_and_leave_everything_as_it_was(engine, tmp_path):
    source = write(tmp_path / "in.jsonl", ROWS[:1])
    existing = tmp_path / "exists.jsonl"
    existing.write_text("keep me\n")
    with pytest.raises(RegenerateError, match=f"{existing} already exists; regenerate never overwrites"):
        run_regenerate(engine, str(source), str(existing), RegenerateOptions(), progress=False)
    assert existing.read_text() == "keep me\n"
    with pytest.raises(RegenerateError, match="is the input file"):
        run_regenerate(engine, str(source), str(source), RegenerateOptions(), progress=False)
    # a partial output from other settings is not continued
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.partial").write_text("")
    (tmp_path / "out.jsonl.partial.json").write_text(json.dumps({"input": "elsewhere", "line": 0, "bytes": 0}))
    with pytest.raises(RegenerateError, match="continues a regeneration with other input, input_digest, options"):
        run_regenerate(engine, str(source), str(out), RegenerateOptions(), progress=False)
    assert (tmp_path / "out.jsonl.partial").read_text() == ""


def supervised_text(tok, sample):
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def test_a_reply_cut_at_max_new_tokens_is_marked_so_the_end_of_turn_after_it_is_not_supervised(engine, tmp_path):
    from specforge_core.data.prepare import prepare_file

    source = write(tmp_path / "in.jsonl", [ROWS[0], ROWS[1], {**ROWS[2], "finish_reason": "stop"}])
    out = tmp_path / "out.jsonl"
    report = run_regenerate(engine, str(source), str(out), RegenerateOptions(max_new_tokens=5), progress=False)
    assert (report.turns, report.cut) == (4, 4)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    replies = [rows[0]["messages"][1], rows[1]["conversations"][1], rows[1]["conversations"][3]]
    assert [m["finish_reason"] for m in replies] == ["length"] * 3
    assert rows[2]["finish_reason"] == "length"  # the prompt form: on the row, the old reason replaced
    tok = engine.tokenizer
    samples, _ = prepare_file(out, tok)
    contents = [rows[0]["messages"][1]["content"], rows[1]["conversations"][1]["value"] +
                rows[1]["conversations"][3]["value"], rows[2]["response"]]
    # each cut reply's own tokens are supervised, and nothing after them: no end-of-turn marker
    assert [supervised_text(tok, s) for s in samples] == contents
    assert all(len(c) > 0 for c in contents)
    # the same rows unmarked supervise one more token per turn: the marker the template writes after each
    unmarked = tmp_path / "unmarked.jsonl"
    for row in rows:
        row.pop("finish_reason", None)
        for message in row.get("messages", row.get("conversations", [])):
            message.pop("finish_reason", None)
    write(unmarked, rows)
    plain, _ = prepare_file(unmarked, tok)
    marker = tok.convert_ids_to_tokens
    assert [sum(p.loss_mask) - sum(s.loss_mask) for p, s in zip(plain, samples)] == [1, 2, 1]
    extra = {marker(t) for p, s in zip(plain, samples) for t, a, b in zip(p.input_ids, p.loss_mask, s.loss_mask)
             if a and not b}
    assert extra == {tok.eos_token}


def test_a_reply_ended_by_a_stop_token_is_not_marked(tiny, tmp_path):
    from specforge_plugin_hf import HFEngineOptions
    from specforge_plugin_hf.engine import HFTargetEngine
    import shutil

    # a target whose generation config names a stop token it does produce (the comma in its "2, 2, ...")
    stopping = tmp_path / "stopping"
    shutil.copytree(tiny, stopping)
    engine = HFTargetEngine(HFEngineOptions(model=str(stopping)))
    comma = engine.tokenizer.convert_tokens_to_ids(",")
    config = json.loads((stopping / "generation_config.json").read_text())
    (stopping / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [
        engine.tokenizer.eos_token_id, comma]}))
    engine = HFTargetEngine(HFEngineOptions(model=str(stopping)))
    assert comma in engine.stop_token_ids()
    source = write(tmp_path / "in.jsonl", [ROWS[0], {**ROWS[2], "finish_reason": "length"}])
    out = tmp_path / "out.jsonl"
    report = run_regenerate(engine, str(source), str(out), RegenerateOptions(max_new_tokens=24), progress=False)
    assert (report.turns, report.cut) == (2, 0)
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert first["messages"][1] == {"role": "assistant", "content": greedy_reply(engine, [first["messages"][0]], 24)}
    assert "finish_reason" not in second  # the old reply's reason went with it


def test_the_command_line(tiny, tmp_path):
    source = write(tmp_path / "in.jsonl", [ROWS[2]])
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a folder would go")
    proc = run_specforge("regenerate", "--target-model", str(tmp_path / "no-model"), "--data", str(source),
                         "--output", str(blocked / "out.jsonl"), expect=1)  # refused before the target is loaded
    assert f"error: the folder of --output {blocked} is a file, not a directory; choose another --output" \
           in proc.stderr and "Traceback" not in proc.stderr
    assert blocked.read_text() == "a file where a folder would go"
    proc = run_specforge("regenerate", "--target-model", str(tiny), "--data", str(source), "--output",
                         str(tmp_path / "new" / "folder" / "out.jsonl"), "--max-new-tokens", "8")
    assert len((tmp_path / "new" / "folder" / "out.jsonl").read_text().splitlines()) == 1
    proc = run_specforge("regenerate", "--target-model", str(tiny), "--data", str(source), "--output",
                         str(tmp_path / "out.jsonl"), "--max-new-tokens", "8")
    assert "1 rows read: 1 written, 0 skipped; 1 replies generated (1 cut at max_new_tokens, marked " \
           '"finish_reason": "length"), 8 tokens at' in proc.stdout
    again = run_specforge("regenerate", "--target-model", str(tiny), "--data", str(source), "--output",
                          str(tmp_path / "out.jsonl"), expect=1)
    assert "already exists; regenerate never overwrites" in again.stderr and "Traceback" not in again.stderr
    bad = run_specforge("regenerate", "--data", str(source), "--output", str(tmp_path / "o2.jsonl"), "--set",
                        "regenerate.temprature=1", expect=2)
    assert "unknown option 'regenerate.temprature'; regenerate accepts: batch_size, max_new_tokens, seed, " \
           "temperature, top_p" in bad.stderr
