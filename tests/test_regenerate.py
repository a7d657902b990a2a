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
    assert first == {"messages": [user, {"role": "assistant", "content": greedy_reply(engine, [user], 24)}],
                     "id": "a"}
    # multi-turn: the second reply answers a conversation whose first reply is already the target's own
    h1 = {"role": "user", "content": "Spell 'cat' backwards."}
    r1 = greedy_reply(engine, [h1], 24)
    h2 = {"role": "user", "content": "How many letters are in 'walrus'?"}
    r2 = greedy_reply(engine, [h1, {"role": "assistant", "content": r1}, h2], 24)
    assert second == {"conversations": [{"from": "human", "value": h1["content"]}, {"from": "gpt", "value": r1},
                                        {"from": "human", "value": h2["content"]}, {"from": "gpt", "value": r2}]}
    assert third == {"prompt": "What is 2 plus 3?",
                     "response": greedy_reply(engine, [{"role": "user", "content": "What is 2 plus 3?"}], 24)}
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Shout the word 'igloo'."}]
    assert fourth == {"system": "Be brief.", "prompt": "Shout the word 'igloo'.",
                      "completion": greedy_reply(engine, system, 24)}
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


def test_the_command_line(tiny, tmp_path):
    source = write(tmp_path / "in.jsonl", [ROWS[2]])
    proc = run_specforge("regenerate", "--target-model", str(tiny), "--data", str(source), "--output",
                         str(tmp_path / "out.jsonl"), "--max-new-tokens", "8")
    assert "1 rows read: 1 written, 0 skipped; 1 replies generated" in proc.stdout
    again = run_specforge("regenerate", "--target-model", str(tiny), "--data", str(source), "--output",
                          str(tmp_path / "out.jsonl"), expect=1)
    assert "already exists; regenerate never overwrites" in again.stderr and "Traceback" not in again.stderr
    bad = run_specforge("regenerate", "--data", str(source), "--output", str(tmp_path / "o2.jsonl"), "--set",
                        "regenerate.temprature=1", expect=2)
    assert "unknown option 'regenerate.temprature'; regenerate accepts: batch_size, max_new_tokens, seed, " \
           "temperature, top_p" in bad.stderr
