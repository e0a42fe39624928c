"""Imported by the fork server that local fine-tuning workers are forked from (motet/api/fine_tuning/workers.py):
the training libraries, once (motet/training/trainer.py `import_libraries`)."""

from motet.training.trainer import import_libraries

import_libraries()
