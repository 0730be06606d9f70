"""Choose a layout: every way to lay a model on a TPU pod, ranked, and why the winner wins.

space        the layouts: factorisations of the chips over the five axes that the model allows
closed_form  memory per chip and step time of one layout, from its shapes and the pod's links
rank         prune by memory, rank by the closed form, re-rank the best few by the compiler
compiled     one layout compiled with ``lab predict``'s machinery and priced op by op
command      ``lab plan``: the options and the handler
"""
