"""Checks by comparing tensors that ModelOpt's draft reads the OUTPUT of decoder layer 15 (= HF
output_hidden_states[16]), and that it equals what bench/peers/features.py gives for hf index 16.
    .venv-peers/modelopt/bin/python bench/peers/modelopt/check_layers.py TARGET_DIR [OUT_NPY]"""
import json, sys
import torch, transformers
import modelopt.torch.speculative as mtsp

tdir = sys.argv[1]
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32)
mtsp.convert(model, [("dflash", {"dflash_block_size": 8, "dflash_mask_token_id": 16, "dflash_num_anchors": 4,
                                  "dflash_use_torch_compile": False, "dflash_self_logit_distillation": False,
                                  "dflash_architecture_config": {"num_hidden_layers": 1, "target_layer_ids": [15]}})])
model.train()
got = {}
model.model.layers[15].register_forward_hook(lambda m, i, o: got.__setitem__("layer15_out", (o[0] if isinstance(o, tuple) else o).detach()))
model.model.layers[16].register_forward_pre_hook(lambda m, a, kw: got.__setitem__("layer16_in", (a[0] if a else kw["hidden_states"]).detach()), with_kwargs=True)
model.dflash_module.register_forward_pre_hook(lambda m, a, kw: got.__setitem__("draft_target_hidden", kw["target_hidden"].detach()), with_kwargs=True)
ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 2, 198, 1, 4093, 198, 19556, 28, 2, 198,
                     1, 520, 9531, 198, 19556, 28, 1083, 2683, 359, 354, 2, 198, 2, 2]])
lab = ids.clone(); lab[:, :18] = -100
model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=lab)
with torch.no_grad():
    hs = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states if False else None
base = transformers.AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
with torch.no_grad():
    hs = base(input_ids=ids, output_hidden_states=True).hidden_states
d = got["draft_target_hidden"][0]
res = {"draft_vs_layer15_output_maxdiff": float((d - got["layer15_out"][0]).abs().max()),
       "draft_vs_layer16_input_maxdiff": float((d - got["layer16_in"][0]).abs().max()),
       "draft_vs_hf_hidden_states[16]": float((d - hs[16][0]).abs().max()),
       "draft_vs_hf_hidden_states[15]": float((d - hs[15][0]).abs().max()),
       "draft_vs_hf_hidden_states[17]": float((d - hs[17][0]).abs().max())}
print(json.dumps(res))
if len(sys.argv) > 2:
    torch.save({"ids": ids, "draft_target_hidden": d}, sys.argv[2])
