"""What a training step optimises: the next-token loss, DPO and GRPO, each a variant chosen by `train.objective`
(`kinds.py`), trained through the step context (`ferry.train.step_context`), with their losses, reference model
and verifiers beside them."""
