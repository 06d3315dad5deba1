"""The config wing, pure: an arm typed (`schema`), loaded from Hydra's composition (`load`), checked
(`checks`) and planned (`plan`), with the factor catalog, the command line's own checks, ad-hoc studies,
the dry run, redaction and shell quoting. Nothing here starts, stops or writes anything."""
