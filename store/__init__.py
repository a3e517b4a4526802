"""rollshard.store"""
