"""Data parallel under a torchrun-style environment (gloo on CPU): two ranks with half a batch each
end with the same weights as one process on the whole batch."""
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine_models import batches, lm_loss, make_model, max_rel_diff, reference_train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str, overlap: bool):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import warnings
    warnings.simplefilter("ignore")
    import lazytrain
    torch.set_num_threads(1)
    model = make_model("modulelist")
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
           "lazytrain": {"checkpoint_interval": 2, "overlap_optimizer": overlap}}
    engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    assert engine.world_size == 2 and engine.gradient_accumulation_steps() == 1
    for x, y in batches(3, batch=4):
        half = slice(2 * rank, 2 * rank + 2)
        engine.backward(lm_loss(engine(x[half]), y[half]))
        engine.step()
    torch.save(engine.module_state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial-update", "overlapped-update"])
def test_two_ranks_equal_one_big_batch(tmp_path, overlap):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), overlap), nprocs=2, join=True)
    ref = reference_train(make_model("modulelist"), batches(3, batch=4), lr=1e-3)
    for rank in (0, 1):
        model = make_model("modulelist")
        model.load_state_dict(torch.load(tmp_path / f"rank{rank}.pt"))
        assert max_rel_diff(model, ref) < 1e-5
