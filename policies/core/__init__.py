"""The bottom layer of policies/: what every policy shares and nothing of ours beneath it.

Flow and Reply (the request and its answer), Clock, Events, Outcome, the base error hierarchy
and the Redis link. Modules here import only the standard library and third-party packages.
"""
