"""rollshard.generate"""
