"""More Hugging Face transformers families, each built from a small config, derived with
``symacct.derive(model, optimizer="adamw")`` alone and exact against a real CPU step at two (B, S), by
``test_transformers.check_exact`` (FLOPs with the CPU flash kernel and grouped matmuls, saved bytes,
parameters, memory after the forward and the peak with AdamW).

Decoders with grouped heads, their own head widths, query/key norms, soft-capping, alternating sliding
windows, partial rotary widths, parallel blocks and mixtures of experts (shared experts, DeepSeek-V3's
latent attention and grouped routing); encoders and sequence-to-sequence models; two vision models. Each
is seconds: CI's slow pass runs them (the default run's 20 minutes), the families of ``test_transformers``
stay in the default run. Eager attention where transformers has no SDPA path for the family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_transformers import check_exact

import symacct

T = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    **IDS,
}


def _decoder(config: str, model: str, **fields: Any) -> Callable[[], Any]:
    return lambda: getattr(T, model)(getattr(T, config)(**{**SMALL, **fields}))


FAMILIES: dict[str, Callable[[], Any]] = {
    "gemma": _decoder("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=8),
    "gemma2-eager": _decoder(
        "Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=8, sliding_window=4,
        attn_implementation="eager",
    ),
    "gemma3": _decoder("Gemma3TextConfig", "Gemma3ForCausalLM", num_key_value_heads=2, head_dim=8, sliding_window=4),
    "qwen3": _decoder("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=8),
    "qwen3-moe": _decoder(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16,
    ),
    "qwen2-moe": _decoder(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
    ),
    "olmo": _decoder("OlmoConfig", "OlmoForCausalLM"),
    "olmo2": _decoder("Olmo2Config", "Olmo2ForCausalLM"),
    "olmoe": _decoder("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2),
    "stablelm": _decoder("StableLmConfig", "StableLmForCausalLM", num_key_value_heads=2),
    "cohere": _decoder("CohereConfig", "CohereForCausalLM"),
    "granite": _decoder("GraniteConfig", "GraniteForCausalLM"),
    "granite-moe": _decoder("GraniteMoeConfig", "GraniteMoeForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    "phi": _decoder("PhiConfig", "PhiForCausalLM"),
    "starcoder2": _decoder("Starcoder2Config", "Starcoder2ForCausalLM", num_key_value_heads=2),
    "persimmon": _decoder("PersimmonConfig", "PersimmonForCausalLM"),
    "nemotron": _decoder("NemotronConfig", "NemotronForCausalLM", num_key_value_heads=2),
    "helium": _decoder("HeliumConfig", "HeliumForCausalLM", num_key_value_heads=2, head_dim=8),
    "glm": _decoder("GlmConfig", "GlmForCausalLM", num_key_value_heads=2, head_dim=8),
    "smollm3": _decoder("SmolLM3Config", "SmolLM3ForCausalLM", num_key_value_heads=2),
    "deepseek-v3": _decoder(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    ),
    "codegen": lambda: T.CodeGenForCausalLM(
        T.CodeGenConfig(n_embd=64, n_layer=2, n_head=8, rotary_dim=4, vocab_size=64, n_positions=64, n_ctx=64, **IDS)
    ),
    "xglm-eager": lambda: T.XGLMForCausalLM(
        T.XGLMConfig(d_model=32, num_layers=2, attention_heads=4, ffn_dim=48, vocab_size=64,
                     max_position_embeddings=64, attn_implementation="eager", **IDS)
    ),
    "roberta": _decoder("RobertaConfig", "RobertaForMaskedLM"),
    "distilbert": lambda: T.DistilBertForMaskedLM(
        T.DistilBertConfig(dim=32, hidden_dim=48, n_layers=2, n_heads=4, vocab_size=64, max_position_embeddings=64)
    ),
    "electra": _decoder("ElectraConfig", "ElectraForMaskedLM", embedding_size=16),
    "deberta-v2-eager": _decoder("DebertaV2Config", "DebertaV2ForMaskedLM", attn_implementation="eager"),
    "mobilebert": _decoder(
        "MobileBertConfig", "MobileBertForMaskedLM", embedding_size=16, intra_bottleneck_size=16,
        true_hidden_size=16,
    ),
    "mbart": lambda: T.MBartForConditionalGeneration(
        T.MBartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, vocab_size=64,
                      max_position_embeddings=64, **IDS)
    ),
    "pegasus": lambda: T.PegasusForConditionalGeneration(
        T.PegasusConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, vocab_size=64,
                        max_position_embeddings=64, **IDS)
    ),
    "marian": lambda: T.MarianMTModel(  # decoder_vocab_size reads as V; its sinusoidal tables are not initialised
        T.MarianConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, vocab_size=64,
                       max_position_embeddings=64, decoder_start_token_id=1, **IDS)
    ),  # fmt: skip
    # transformers 5.25 families added at stop 53 (each exact as built here, on the first hunt or after its fix)
    "afmoe": _decoder("AfmoeConfig", "AfmoeForCausalLM", num_key_value_heads=2, head_dim=8, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16),
    "apertus": _decoder("ApertusConfig", "ApertusForCausalLM", num_key_value_heads=2),
    "arcee": _decoder("ArceeConfig", "ArceeForCausalLM", num_key_value_heads=2),
    "aria-text": _decoder("AriaTextConfig", "AriaTextForCausalLM", num_key_value_heads=2, moe_num_experts=4,
                          moe_topk=2, moe_intermediate_size=16, moe_num_shared_experts=1),
    "biogpt": _decoder("BioGptConfig", "BioGptForCausalLM"),
    "big-bird": lambda: T.BigBirdForCausalLM(  # its first call builds full-attention modules: traced as a second
        T.BigBirdConfig(**{**SMALL, "is_decoder": True})
    ),
    "hunyuan-moe-one-expert": _decoder(  # E kept at 1: its widths still probed as the grouped matmuls want
        "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", num_key_value_heads=2, head_dim=8, num_experts=1
    ),
    "openai-gpt": lambda: T.OpenAIGPTLMHeadModel(  # one gelu_new instance shared by every block
        T.OpenAIGPTConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64)
    ),
    "bitnet": _decoder("BitNetConfig", "BitNetForCausalLM", num_key_value_heads=2),
    "cohere2": _decoder("Cohere2Config", "Cohere2ForCausalLM", num_key_value_heads=2, sliding_window=4),
    "deepseek-v2": _decoder(
        "DeepseekV2Config", "DeepseekV2ForCausalLM", num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    ),
    "diffllama": _decoder("DiffLlamaConfig", "DiffLlamaForCausalLM", num_key_value_heads=2),
    "doge": _decoder("DogeConfig", "DogeForCausalLM", num_key_value_heads=2),
    "ernie4.5": _decoder("Ernie4_5Config", "Ernie4_5ForCausalLM", num_key_value_heads=2, head_dim=8),
    "ernie4.5-moe": _decoder("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", num_key_value_heads=2,
                             moe_num_experts=4, moe_k=2, moe_intermediate_size=16),
    "exaone4": _decoder("Exaone4Config", "Exaone4ForCausalLM", num_key_value_heads=2, head_dim=8,
                        sliding_window=4),
    "flex-olmo": _decoder("FlexOlmoConfig", "FlexOlmoForCausalLM", num_experts=4, num_experts_per_tok=2),
    "gemma4": _decoder("Gemma4TextConfig", "Gemma4ForCausalLM", num_hidden_layers=6, num_key_value_heads=2,
                       head_dim=8, global_head_dim=16, sliding_window=4, hidden_size_per_layer_input=8,
                       vocab_size_per_layer_input=64),
    "glm4": _decoder("Glm4Config", "Glm4ForCausalLM", num_key_value_heads=2, head_dim=8),
    "glm4-moe": _decoder("Glm4MoeConfig", "Glm4MoeForCausalLM", num_key_value_heads=2, head_dim=8,
                         n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1,
                         topk_group=1, first_k_dense_replace=1),
    "granite-moe-shared": _decoder("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", num_local_experts=4,
                                   num_experts_per_tok=2, shared_intermediate_size=16),
    "hunyuan-dense": _decoder("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", num_key_value_heads=2,
                              head_dim=8),
    "hunyuan-moe": _decoder("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", num_key_value_heads=2, head_dim=8,
                            num_experts=4, moe_topk=2, moe_intermediate_size=16),
    "lfm2": _decoder("Lfm2Config", "Lfm2ForCausalLM", num_key_value_heads=2),
    "llama4-text": _decoder("Llama4TextConfig", "Llama4ForCausalLM", num_key_value_heads=2, head_dim=8,
                            intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1),
    "minimax-m2": _decoder("MiniMaxM2Config", "MiniMaxM2ForCausalLM", num_key_value_heads=2, head_dim=8,
                           num_local_experts=4, num_experts_per_tok=2),
    "ministral": _decoder("MinistralConfig", "MinistralForCausalLM", num_key_value_heads=2, head_dim=8,
                          sliding_window=4),
    "olmo3": _decoder("Olmo3Config", "Olmo3ForCausalLM", num_key_value_heads=2, sliding_window=4),
    "seed-oss": _decoder("SeedOssConfig", "SeedOssForCausalLM", num_key_value_heads=2, head_dim=8),
    "convbert": _decoder("ConvBertConfig", "ConvBertForMaskedLM", embedding_size=32),
    "convnext": lambda: T.ConvNextForImageClassification(
        T.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 2], num_stages=2, image_size=32)
    ),
    "dinov2": lambda: T.Dinov2ForImageClassification(
        T.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                       image_size=32, patch_size=8, num_labels=3)
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_built_from_a_small_config_is_exact(family: str) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family]()
    check_exact(model, symacct.derive(model, optimizer="adamw"), [(2, 7), (3, 11)])
