"""Studies shipped with heisenhunt.

A Hydra search path entry whose `experiment/` group is the top-level experiments/ folder (a symlink
here, real files in a wheel), so `+experiment=NAME` finds them in any install."""
