"""hsx training jobs: `hsx train-drafter` where it needs more than one process — data-parallel replicas on Ray
Train, and drafters trained from a live extraction (nothing stored). One training session itself is training's.

    config.py          TrainJobConfig: `hsx train-drafter`'s settings, the trainer's (training) and Ray's
    train.py           train_drafter: in this process, or (--workers N) the trainer's data-parallel replicas on Ray Train
    live.py            `hsx train-drafter --online`: a drafter trained from a live extraction, nothing stored
    fanout.py          `hsx train-drafter --online --fanout`: several drafters trained from one live extraction

Imports jobs (the extraction a live training runs), training, cluster and the floors below.
"""
