"""The model index: unimp-torch's ``model_index`` of the user's model (indexed before IPEX renames its classes)."""

from unimp_torch.extension import model_index as model_index
