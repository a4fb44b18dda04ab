"""Where models run: model and tokenizer building (`models`), the SFT warm-up (`sft`), rollout and training
engines (`engines/`), the workers that hold them (`workers/`), and the Ray cluster or in-process host
(`cluster`).
"""
