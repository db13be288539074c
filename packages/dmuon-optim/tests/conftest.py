import torch

# CI runs on 2 cores next to other jobs; keep torch from oversubscribing them.
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
