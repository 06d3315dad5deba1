"""Studies shipped with heisenhunt: the Hydra search path entry whose `experiment/` group is the top-level experiments/ folder."""
