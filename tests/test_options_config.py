"""Option validation and run-plan resolution: errors name the key and the accepted form."""

import attrs
import pytest

from specforge_core.config import TrainOptions, apply_sets, resolve_plan
from specforge_core.errors import OptionError, UnknownComponentError
from specforge_core.options import build_options, describe_options, option, positive


@attrs.frozen
class Knobs:
    ttt_length: int = option(7, "Unroll steps.", check=positive)
    layer_ids: list[int] | None = option(None, "Layers.")
    decay: float = option(0.8, "Decay.")
    mode: str = option("a", "Mode.", choices=("a", "b"))
    flag: bool = option(False, "Flag.")


def test_options_are_coerced_from_strings_and_yaml_values():
    knobs = build_options(Knobs, {"ttt_length": "5", "layer_ids": "1,2,3", "decay": "1e-1", "flag": "true"},
                          section="strategy")
    assert knobs == Knobs(ttt_length=5, layer_ids=[1, 2, 3], decay=0.1, flag=True)


@pytest.mark.parametrize("values, message", [
    ({"ttt_lenght": 3}, r"unknown option 'strategy\.ttt_lenght'; strategy accepts: decay, flag, layer_ids, mode, "
                        r"ttt_length"),
    ({"ttt_length": "many"}, r"option 'strategy\.ttt_length': expected an integer, got 'many'"),
    ({"ttt_length": 2.5}, r"option 'strategy\.ttt_length': expected an integer, got 2\.5"),
    ({"ttt_length": 0}, r"option 'strategy\.ttt_length' must be > 0; got 0"),
    ({"mode": "c"}, r"option 'strategy\.mode': expected one of a, b; got 'c'"),
    ({"flag": "maybe"}, r"option 'strategy\.flag': expected true or false, got 'maybe'"),
    ({"decay": "fast"}, r"option 'strategy\.decay': expected a number \(e\.g\. 1e-4\), got 'fast'"),
    ({"layer_ids": "x,y"}, r"option 'strategy\.layer_ids': expected list of int \(e\.g\. \[1, 2\]\) or null"),
])
def test_bad_option_names_the_key_and_the_accepted_form(values, message):
    with pytest.raises(OptionError, match=message):
        build_options(Knobs, values, section="strategy")


def test_describe_options_lists_defaults_and_docs():
    rows = {row["name"]: row for row in describe_options(Knobs)}
    assert rows["ttt_length"] == {"name": "ttt_length", "type": "int", "default": 7, "doc": "Unroll steps."}


def test_set_assignments_parse_yaml_scalars_into_sections():
    raw = apply_sets({"strategy": "x"}, ["train.lr=3e-4", "strategy.ttt_length=5", "data.path=a.jsonl"])
    assert raw == {"strategy": {"name": "x", "ttt_length": 5}, "train": {"lr": 3e-4}, "data": {"path": "a.jsonl"}}


@pytest.mark.parametrize("item, message", [
    ("train.lr", r"expected the form section\.key=value"),
    ("lr=1", r"expected the form section\.key=value"),
    ("trainer.lr=1", r"unknown section 'trainer'; sections: strategy, target_engine"),
])
def test_bad_set_assignment_is_refused(item, message):
    with pytest.raises(OptionError, match=message):
        apply_sets({}, [item])


def test_resolve_plan_validates_components_and_train_options(fake_site):
    manager = fake_site.manager()
    raw = {"strategy": "nothing-here", "target_engine": "also-missing"}
    with pytest.raises(UnknownComponentError, match="unknown strategy 'nothing-here'. Available: \\(none\\)"):
        resolve_plan(manager, raw)
    with pytest.raises(OptionError, match="unknown config section 'trian'"):
        resolve_plan(manager, {"trian": {}})


def test_train_options_defaults_are_sane():
    train = TrainOptions()
    assert (train.batch_size, train.accumulation_steps, train.schedule, train.max_grad_norm) == (4, 1, "cosine", 1.0)
