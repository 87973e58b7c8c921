"""The `zerodp train` application: the main job, outside the library's core.

It trains the bundled GPT (`zerodp.tools.models.gpt`) on a byte corpus that needs no download, through the
public API only (`zerodp.initialize`), and writes a run folder with metrics, a loss plot and a summary:

    train.py       launching the ranks (torchrun's elastic agent) and each rank's training loop
    train_args.py  the job's options, resolved and checked before any rank starts
    corpus.py      the byte corpus (the Python standard library's source) and each rank's slice of a batch
    report.py      metrics log, loss plot and the summary a run ends with
    run_folder.py  where a run writes, its checkpoints and the newest one to restart from

The library never imports this package; `cli/` does, for `zerodp train`.

    device.py  Where `zerodp train` puts a rank's tensors, how many ranks it starts, and the GPU memory it ...
"""
