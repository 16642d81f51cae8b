"""An async save returns before its state is copied; the optimizer step that follows must not
change the tensors under the copy. Here the step comes at once, while the copy of the debug
model's 90 MB of model and optimizer state is still running in the background."""

from dataclasses import replace

import torch
import torch.distributed.checkpoint as dcp
from conftest import checkpointed_run, checkpointed_training, materialize
from torch.distributed.checkpoint import FileSystemReader
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.checkpoint.async_save import host_tensors
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.config_sections import Checkpoint
from titanlite.models import get_model_args, get_model_spec


def backward(model, vocab_size: int) -> None:
    tokens = torch.randint(vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def test_the_optimizer_step_after_an_async_save_waits_for_its_copy_into_reused_buffers(tmp_path, world_of_one):
    spec = get_model_spec("llama3")
    args = replace(get_model_args(spec, "debugmodel"), vocab_size=2256)  # the shipped tokenizer's
    model = materialize("llama3", args)
    # Reversed: the step updates first the tensors the copy reaches last (the output layer, its moments).
    optimizer = torch.optim.AdamW(reversed(list(model.parameters())), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    backward(model, args.vocab_size)
    optimizer.step()  # the optimizer now has its moments, saved with the model
    backward(model, args.vocab_size)  # gradients for the step right after the save

    run = checkpointed_run(
        model,
        replace(Checkpoint(), enable=True, interval=1, async_mode="async"),
        tmp_path,
        "llama3/debugmodel",
        args,
        spec,
    )
    manager = CheckpointManager(run, checkpointed_training(optimizer, scheduler, StatefulDataLoader(list(range(4)))))
    saved_at = {}
    for step in (1, 2):  # the second save copies into the host buffers the first one made
        at_save = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        at_save["optimizer.state.output.weight.exp_avg"] = optimizer.state[model.output.weight]["exp_avg"].clone()
        manager.maybe_save(step)
        assert manager.saver.pending is not None  # the save is running in the background
        optimizer.step()
        manager.wait()
        buffers = [t.data_ptr() for t in host_tensors(manager.saver.staging.buffers)]
        if step == 1:
            first_buffers = buffers
        saved_at[step] = at_save
        changed = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, at_save[name])]
        assert len(changed) == len(model.state_dict())  # the step did change every weight in place...
        backward(model, args.vocab_size)
    manager.close()
    assert buffers == first_buffers

    for step, at_save in saved_at.items():
        folder = tmp_path / "checkpoint" / f"step-{step}"
        metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        saved = {name: torch.empty(tensor.shape) for name, tensor in at_save.items()}
        assert saved.keys() <= metadata.keys()
        dcp.load(saved, checkpoint_id=str(folder))
        for name, tensor in at_save.items():  # ...but each checkpoint holds them as they were at its save
            assert torch.equal(saved[name], tensor), (step, name)
