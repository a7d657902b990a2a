"""Speculative decoding with an EAGLE3 draft is lossless: output == the target's greedy decode."""

import pytest
import torch

from specforge_core.protocols import DataStats, TargetInfo

from specforge_plugin_eagle3 import Eagle3Options
from specforge_plugin_eagle3.model import DraftKV
from specforge_plugin_eagle3.speculate import speculate
from specforge_plugin_eagle3.strategy import Eagle3Strategy

transformers = pytest.importorskip("transformers")
# the keyword a forward takes its KV cache by in the installed transformers, as the hf engine picks it
_cache_keyword = pytest.importorskip("specforge_plugin_hf.engine")._cache_keyword

V, H, LAYERS = 96, 32, 4


@pytest.fixture(scope="module")
def llama():
    """A random 4-layer Llama with peaked logits (so greedy choices are far from ties)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    model.requires_grad_(False)
    return model


def target_info(model):
    c = model.config
    return TargetInfo(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                      extra={"num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                             "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
                             "max_position_embeddings": c.max_position_embeddings})


def frozen_parts(model):
    return {"embed_tokens": model.model.embed_tokens.weight, "lm_head": model.lm_head.weight}


class LlamaSession:
    """A KV-cached VerifySession over a transformers Llama, shaped like the hf engine's."""

    def __init__(self, model, prompt, layer_ids):
        self.model, self.layer_ids = model, layer_ids
        self.cache = transformers.DynamicCache(config=model.config)
        self.cache_keyword = _cache_keyword(model)
        self.length = 0
        self.forwards = 0
        self.prefill = self.extend(torch.as_tensor(prompt))

    @torch.no_grad()
    def extend(self, ids):
        out = self.model(input_ids=ids[None], use_cache=True, output_hidden_states=True,
                         **{self.cache_keyword: self.cache})
        self.length += len(ids)
        self.forwards += 1
        states = out.hidden_states
        return {"logits": out.logits[0], "last_hidden": states[-1][0],
                "aux_hidden": torch.cat([states[i + 1][0] for i in self.layer_ids], -1)}

    def truncate(self, length):
        if length < self.length:
            self.cache.crop(length - self.length)  # transformers 5: a negative count drops that many
        self.length = length


@torch.no_grad()
def greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def prompts(count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


def draft_for(llama, **options):
    strategy = Eagle3Strategy(Eagle3Options(**options))
    info = target_info(llama)
    counts = torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(1))
    return strategy, strategy.build_model(info, frozen_parts(llama), DataStats(token_counts=counts)).eval()


def test_speculative_output_equals_greedy_decode_on_many_prompts(llama):
    strategy, model = draft_for(llama, ttt_length=3, spec_depth=4, draft_vocab_size=64)
    layers = strategy.capture_plan(target_info(llama)).layer_ids
    for prompt in prompts(24):
        session = LlamaSession(llama, prompt, layers)
        result = strategy.speculate(model, session, prompt, max_new_tokens=20, eos_token_id=None)
        assert result.tokens == greedy(llama, prompt, 20), prompt
        assert sum(result.accept_lengths) == len(result.tokens)
        assert result.target_forwards == len(result.accept_lengths) == session.forwards
        assert all(1 <= n <= 5 for n in result.accept_lengths)


class OracleDraft:
    """A stand-in draft that proposes the target's own greedy continuation, except at ``wrong``."""

    def __init__(self, reference, wrong=()):
        self.reference, self.wrong, self.seen = reference, set(wrong), 0

    def draft(self, kv, aux_hidden, next_ids, depth):
        assert isinstance(kv, DraftKV) and len(aux_hidden) == len(next_ids)
        self.seen += len(next_ids)  # next_ids[-1] is the token at sequence index self.seen
        out = []
        for i in range(self.seen + 1, self.seen + 1 + depth):
            out.append((self.reference[i] + 1) % V if i in self.wrong else self.reference[i])
        return out


def test_correct_drafts_are_all_accepted_and_a_wrong_one_cuts_the_round(llama):
    prompt, layers = [5, 17, 33, 8], (0, 2, 3)
    reference = prompt + greedy(llama, prompt, 16)
    perfect = speculate(OracleDraft(reference), LlamaSession(llama, prompt, layers), prompt, max_new_tokens=16,
                        eos_token_id=None, depth=4)
    assert perfect.tokens == reference[len(prompt):]
    assert perfect.accept_lengths == [1, 5, 5, 5]  # the prompt forward's token, then depth + bonus per round
    # second round drafts sequence indices 10..13; index 11 wrong: 1 accepted + the target's token
    cut = speculate(OracleDraft(reference, wrong={11}), LlamaSession(llama, prompt, layers), prompt,
                    max_new_tokens=16, eos_token_id=None, depth=4)
    assert cut.tokens == reference[len(prompt):]
    assert cut.accept_lengths == [1, 5, 2, 5, 3]


def test_decoding_stops_after_eos_and_at_max_new_tokens(llama):
    strategy, model = draft_for(llama, ttt_length=2, spec_depth=3)
    layers = strategy.capture_plan(target_info(llama)).layer_ids
    prompt = prompts(1, seed=4)[0]
    reference = greedy(llama, prompt, 12)
    eos = reference[5]
    stop = reference.index(eos)
    result = strategy.speculate(model, LlamaSession(llama, prompt, layers), prompt, max_new_tokens=12,
                                eos_token_id=[eos, 10_000])
    assert result.tokens == reference[: stop + 1]
    for n in (1, 2, 7):
        result = strategy.speculate(model, LlamaSession(llama, prompt, layers), prompt, max_new_tokens=n,
                                    eos_token_id=None)
        assert result.tokens == reference[:n] and sum(result.accept_lengths) == n
    nothing = strategy.speculate(model, LlamaSession(llama, prompt, layers), prompt, max_new_tokens=0,
                                 eos_token_id=None)
    assert (nothing.tokens, nothing.target_forwards, nothing.accept_lengths) == ([], 0, [])


def test_drafting_with_a_cache_reproduces_the_training_unroll_at_the_chain_start(llama):
    strategy, model = draft_for(llama, ttt_length=4, draft_vocab_size=64)
    gen = torch.Generator().manual_seed(2)
    n, depth = 9, 4
    aux = torch.randn(n + depth, 3 * H, generator=gen)
    next_ids = torch.randint(3, V, (n,), generator=gen).tolist()
    kv = DraftKV()
    assert model.draft(kv, aux[:5], next_ids[:5], 2) and kv.length == 5 and not kv.diag  # an earlier round
    drafts = model.draft(kv, aux[5:n], next_ids[5:], depth)
    # training: position n-1 at step k consumes token (n-1)+k of the aligned ids
    ids = torch.tensor([next_ids + drafts[:-1]])
    with torch.no_grad():
        logits = model(ids, aux[None, : ids.shape[1]], torch.ones_like(ids), depth)
    unrolled = [int(model.to_target_ids(step[0, n - 1].argmax())) for step in logits]
    assert unrolled == drafts


def make_engine_folder(llama, path):
    """Save the random Llama with a word-level tokenizer, as the hf engine loads a local target."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0",
                                                bos_token="t1", eos_token="t2")
    fast.save_pretrained(path)
    llama.save_pretrained(path)
    return path


def test_speculation_through_the_hf_engine_equals_its_greedy_decode(llama, tmp_path):
    engine_module = pytest.importorskip("specforge_plugin_hf.engine")
    from specforge_plugin_hf import HFEngineOptions

    engine = engine_module.HFTargetEngine(HFEngineOptions(model=str(make_engine_folder(llama, tmp_path / "target")),
                                                          device="cpu", dtype="float32"))
    info = engine.info()
    strategy = Eagle3Strategy(Eagle3Options(ttt_length=3, spec_depth=3))
    model = strategy.build_model(info, engine.frozen_parts(), DataStats()).eval()
    plan = strategy.capture_plan(info)
    for prompt in prompts(4, seed=7):
        result = strategy.speculate(model, engine.session(torch.tensor(prompt), plan), prompt, max_new_tokens=12,
                                    eos_token_id=None)
        assert result.tokens == greedy(engine.model, prompt, 12)


def test_a_trained_draft_is_accepted_where_an_untrained_one_is_not(llama):
    """Train on the target's own greedy continuations; real acceptance then rises (and stays lossless)."""
    from specforge_core.contracts import StepContext

    info = target_info(llama)
    strategy = Eagle3Strategy(Eagle3Options(ttt_length=3, spec_depth=3))
    layers = strategy.capture_plan(info).layer_ids
    train_prompts, samples = prompts(32, seed=11), []
    for prompt in train_prompts:
        ids = prompt + greedy(llama, prompt, 24)
        features = LlamaSession(llama, ids, layers).prefill  # capture: one forward over the whole sequence
        loss_mask = torch.zeros(len(ids), dtype=torch.long)
        loss_mask[len(prompt):] = 1
        samples.append({"input_ids": torch.tensor(ids), "loss_mask": loss_mask,
                        "aux_hidden": features["aux_hidden"], "last_hidden": features["last_hidden"]})
    counts = sum(torch.bincount(s["input_ids"][s["loss_mask"].bool()], minlength=V) for s in samples)
    model = strategy.build_model(info, frozen_parts(llama), DataStats(token_counts=counts))

    def mean_accepted():
        model.eval()
        lengths = []
        for prompt in train_prompts[:12]:
            result = strategy.speculate(model, LlamaSession(llama, prompt, layers), prompt, max_new_tokens=24,
                                        eos_token_id=None)
            assert result.tokens == greedy(llama, prompt, 24)
            lengths += result.accept_lengths[1:]
        model.train()
        return sum(lengths) / len(lengths)

    before = mean_accepted()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(250):
        rows = torch.randint(0, len(samples), (8,), generator=gen).tolist()
        out = strategy.forward_loss(model, strategy.collate([samples[i] for i in rows], [str(i) for i in rows]),
                                    StepContext())
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    after = mean_accepted()
    assert before < 1.1 and after > 1.25, (before, after)
