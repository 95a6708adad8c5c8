"""The bottom layer of policies/: what every policy shares and nothing of ours beneath it.

Flow and Reply (the request and its answer), Clock, Events, Outcome, the base error hierarchy,
the Redis link, the config validators, and what vendor records are written in (the vendor
profile, unified options). Modules here import only the standard library and third parties.
"""
