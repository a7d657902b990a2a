"""Speculative decoding through the hf engine is token-identical to the target's greedy decode."""

import random

import pytest
import torch

from specforge_core.protocols import BuildContext, DataStats

from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.speculate import speculative_decode
from specforge_plugin_dflash.strategy import DFlashStrategy

engine_module = pytest.importorskip("specforge_plugin_hf.engine")

VOCAB = 96


def save_random_target(folder, architecture):
    """A random transformers causal LM and a word-level tokenizer, as save_pretrained writes them."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 3)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                                     eos_token="<eos>")
    config_class, model_class = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                                 "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[architecture]
    window = {"sliding_window": 6} if architecture == "mistral" else {}  # windowed layers, rolled back past 6
    config = config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                          tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, **window)
    torch.manual_seed({"qwen3": 1, "llama": 2, "mistral": 3}[architecture])
    model_class(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["qwen3", "llama", "mistral"])
def engine(request, tmp_path_factory):
    folder = save_random_target(tmp_path_factory.mktemp(request.param), request.param)
    from specforge_plugin_hf import HFEngineOptions

    return engine_module.HFTargetEngine(HFEngineOptions(model=str(folder), dtype="float32", device="cpu"),
                                        BuildContext())


def draft_for(engine, **options):
    strategy = DFlashStrategy(DFlashOptions(**{"block_size": 4, **options}), BuildContext())
    info = engine.info()
    torch.manual_seed(0)
    return strategy, strategy.build_model(info, engine.frozen_parts(), DataStats()), strategy.capture_plan(info)


def greedy(engine, plan, prompt, max_new_tokens, eos=None):
    """The target's own greedy decode, one token per forward."""
    session = engine.session(prompt, plan)
    tokens = [int(session.prefill["logits"][-1].argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] != eos:
        tokens.append(int(session.extend(torch.tensor([tokens[-1]]))["logits"][-1].argmax()))
    return tokens


def prompts(count, seed=0):
    rng = random.Random(seed)
    return [torch.tensor([rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 20))]) for _ in range(count)]


def oracle_draft(reference, prompt_len, wrong_rate, seed):
    """A draft that knows the greedy continuation and gets each token wrong with probability ``wrong_rate``."""
    rng = random.Random(seed)

    def draft(model, ctx, anchor_token, position):
        assert ctx.shape[1] == position  # the context is every token before the anchor
        start = position - prompt_len + 1  # reference index of block position 1
        out = []
        for i in range(start, start + model.config.block_size - 1):
            token = reference[i] if i < len(reference) else 3
            out.append((token + 1) % VOCAB if rng.random() < wrong_rate else token)
        return torch.tensor(out)

    return draft


def test_speculate_with_an_untrained_draft_equals_target_greedy_on_many_prompts(engine):
    strategy, model, plan = draft_for(engine)
    for prompt in prompts(12):
        result = strategy.speculate(model, engine.session(prompt, plan), prompt, max_new_tokens=20, eos_token_id=None)
        assert result.tokens == greedy(engine, plan, prompt, 20)
        assert sum(result.accept_lengths) == len(result.tokens) == 20
        assert result.target_forwards == len(result.accept_lengths)


@pytest.mark.parametrize("wrong_rate", [0.0, 0.2, 0.5])
def test_accepted_prefixes_of_every_length_keep_the_output_identical(engine, wrong_rate):
    _strategy, model, plan = draft_for(engine, block_size=6)
    seen = set()
    for index, prompt in enumerate(prompts(8, seed=1)):
        reference = greedy(engine, plan, prompt, 30)
        result = speculative_decode(model, engine.session(prompt, plan), prompt, feature=plan.hidden_feature,
                                    max_new_tokens=30, draft=oracle_draft(reference, len(prompt), wrong_rate, index))
        assert result.tokens == reference
        assert sum(result.accept_lengths) == 30 and max(result.accept_lengths) <= 6
        seen.update(result.accept_lengths[1:])
    if wrong_rate == 0.0:
        assert seen <= {6, 5, 4, 3, 2, 1} and 6 in seen  # a perfect draft fills whole blocks
    else:
        assert len(seen) >= 3


def test_decoding_stops_after_the_eos_token_and_respects_max_new_tokens(engine):
    _strategy, model, plan = draft_for(engine, block_size=5)
    prompt = prompts(1, seed=3)[0]
    reference = greedy(engine, plan, prompt, 25)
    eos = reference[7]
    stop_at = reference.index(eos)
    result = speculative_decode(model, engine.session(prompt, plan), prompt, feature=plan.hidden_feature,
                                max_new_tokens=25, eos_token_id=eos, draft=oracle_draft(reference, len(prompt), 0, 0))
    assert result.tokens == reference[: stop_at + 1]
    # a perfect draft: every round's 4 drafts are accepted; the last round ends on the EOS among them, no bonus
    assert result.accepted_drafts == [min(4, n) for n in result.accept_lengths[1:]]
    if len(result.accept_lengths) > 1 and stop_at % 5:  # the EOS is a draft, not a round's bonus: none after it
        assert result.accepted_drafts[-1] == result.accept_lengths[-1]
    session = engine.session(prompt, plan)
    verified = []  # positions each verification runs through the target
    extend = session.extend
    session.extend = lambda ids: verified.append(len(ids)) or extend(ids)
    short = speculative_decode(model, session, prompt, feature=plan.hidden_feature,
                               max_new_tokens=3, draft=oracle_draft(reference, len(prompt), 0, 0))
    assert short.tokens == reference[:3] and short.accept_lengths == [1, 2]
    # two tokens were left: the round verified the anchor and one draft, not the block's four (bs 5), and emitted
    # that draft and the target's bonus after it
    assert verified == [2] and short.accepted_drafts == [1]


def test_an_empty_session_is_prefilled_by_speculate(engine):
    strategy, model, plan = draft_for(engine)
    prompt = prompts(1, seed=4)[0]
    result = strategy.speculate(model, engine.session(None, plan), prompt, max_new_tokens=10, eos_token_id=None)
    assert result.tokens == greedy(engine, plan, prompt, 10)


def test_a_session_holding_more_than_the_prompt_is_refused(engine):
    strategy, model, plan = draft_for(engine)
    prompt = prompts(1, seed=5)[0]
    session = engine.session(prompt, plan)
    session.extend(torch.tensor([1], dtype=torch.long))
    with pytest.raises(ValueError, match=rf"holding exactly the prompt \({len(prompt)} tokens.*this one holds "
                                         rf"{len(prompt) + 1} positions"):
        strategy.speculate(model, session, prompt, max_new_tokens=4, eos_token_id=None)
