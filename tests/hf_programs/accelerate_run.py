"""An accelerate training loop as people write them, run through LazyTrain by the one line marked below.

    python accelerate_run.py OUT --config zero2|zero3|plain

The loop is accelerate's documented one (prepare, accumulate, backward, clip, step). Under DeepSpeed the
optimizer and schedule are the script's own (torch's AdamW, a LambdaLR), handed to the engine through
``prepare``; ``plain`` runs the same loop without DeepSpeed. Writes OUT/result.pt and OUT/final (saved with
``save_pretrained(state_dict=accelerator.get_state_dict(model))``)."""
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, Tokens, script_args, tiny_gpt2, warmup_lr_factor  # noqa: E402

a = script_args()

if a.config != "plain":
    import lazytrain
    lazytrain.replace_deepspeed()      # the one line

from accelerate import Accelerator, DeepSpeedPlugin  # noqa: E402

plugin = None
if a.config != "plain":
    ds_config = copy.deepcopy(CONFIGS[a.config])
    del ds_config["optimizer"], ds_config["scheduler"]     # the script's own optimizer and schedule
    ds_config["gradient_clipping"] = 0.5
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
accelerator = Accelerator(gradient_accumulation_steps=2, deepspeed_plugin=plugin)
torch.manual_seed(7)
model = tiny_gpt2()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lr_factor)
loader = torch.utils.data.DataLoader(Tokens(16), batch_size=2, shuffle=True,
                                     generator=torch.Generator().manual_seed(3))
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
model.train()
losses = []
for batch in loader:
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
accelerator.wait_for_everyone()
unwrapped = accelerator.unwrap_model(model)
unwrapped.save_pretrained(os.path.join(a.out, "final"), state_dict=accelerator.get_state_dict(model))
if a.config != "plain":
    assert type(model).__name__ == "LazyTrainEngine", type(model)
    # ZeRO offloads the optimizer and the config names none: the script's own AdamW, not DeepSpeed's CPU Adam
    assert type(model.optimizer) is torch.optim.AdamW, type(model.optimizer)
    weights = model.module_state_dict()
else:
    weights = {k: v.clone() for k, v in unwrapped.state_dict().items()}
torch.save({"weights": weights, "losses": losses}, os.path.join(a.out, "result.pt"))
