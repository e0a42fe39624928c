"""Fine-tuning: a tenant's examples in OpenAI's formats in, a PEFT LoRA adapter out, trained with PEFT and TRL.

Plain synchronous code, in four parts: the data (data_format.py: OpenAI's chat and preference formats, validated
line by line; chat_encoding.py: the examples rendered with the chat template serving renders and tokenized, the
loss on the assistant turns; dataset.py: a file made ready to train), the run (hyperparameters.py: OpenAI's
hyperparameters, `auto` resolved; trainer.py: TRL's SFTTrainer or DPOTrainer on a PEFT LoRA model, a checkpoint
an epoch, resumable), the child process a job runs in (worker.py) and the order jobs run in (fair_queue.py).
The server's fine-tuning API (motet/api/fine_tuning/) and `motet fine-tune` (motet/api/fine_tune_command.py) drive
them.
"""
